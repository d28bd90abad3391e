"""Low-memory layouts (ampfunc.lowmem): split masters and bf16/q8 moments, tree by tree.

The reference Adam/AdamW step of the low-memory settings is written here from its definition:
rebuild the fp32 master and moments, take ``torch.optim.AdamW``'s own step on them, store them
back (re-quantize, split). The library's paths are checked against it where they exist.
"""

import io

import pytest
import torch

from ampfunc.lowbits import Q8_BLOCK, dequantize_q8, join_bf16, quantize_q8, split_bf16
from ampfunc.lowmem import (
    Q8Moment,
    SplitMaster,
    check_moment,
    check_split_master,
    decode_moment,
    encode_moment,
    init_moment,
    init_split_master,
    join_master,
    split_master,
    storage_bytes,
)


def _params(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(64, 128, generator=g).to(dtype),   # 8192: q8
            "w": torch.randn(96, 64, generator=g).to(dtype),      # 6144: q8 (24 blocks)
            "odd": torch.randn(4100, generator=g).to(dtype),      # not a multiple of 256: fp32
            "small": torch.randn(100, generator=g).to(dtype),     # under 4096: fp32
            "ln": torch.randn(64, generator=g)}                   # an fp32 param: its own master


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same_bits(a, b):
    if a.dtype.is_floating_point:
        a = a.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()])
        b = b.view(a.dtype)
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


def test_split_master_layout_and_round_trip():
    params = _params()
    sm = init_split_master(params, "t")
    assert isinstance(sm, SplitMaster)
    assert sm.remainder["emb"].dtype == torch.int16 and sm.remainder["emb"].shape == (64, 128)
    assert sm.remainder["ln"].shape == (0,)
    masters = join_master(params, sm)
    assert masters["ln"] is params["ln"] and masters["w"].dtype == torch.float32
    assert bool((masters["w"] == params["w"].float()).all())
    # a moved master splits into new params and remainders that join back to it exactly
    moved = {k: v + 1e-4 * torch.randn_like(v) for k, v in masters.items()}
    new_params, new_sm = split_master(moved, params)
    assert new_params["w"].dtype == torch.bfloat16 and new_params["ln"].dtype == torch.float32
    back = join_master(new_params, new_sm)
    assert all(_same_bits(back[k], moved[k]) for k in moved)
    check_split_master(new_params, new_sm, "t")
    loaded = _roundtrip((new_params, new_sm))
    assert isinstance(loaded[1], SplitMaster)
    assert all(_same_bits(join_master(*loaded)[k], moved[k]) for k in moved)


def test_split_master_refusals_name_the_leaf():
    with pytest.raises(ValueError, match="'h' is float16"):
        init_split_master({"a": torch.ones(2, dtype=torch.bfloat16), "h": torch.ones(2, dtype=torch.float16)}, "t")
    with pytest.raises(TypeError, match="'i'"):
        init_split_master({"i": torch.ones(2, dtype=torch.int64)}, "t")
    params = _params()
    sm = init_split_master(params, "t")
    other = dict(params, w=params["w"].float())  # a param now fp32: the state was made for bf16
    with pytest.raises(ValueError, match="'w'.*remainder of torch.int16"):
        check_split_master(other, sm, "t")
    with pytest.raises(TypeError, match="not the SplitMaster"):
        check_split_master(params, {"w": torch.zeros(2)}, "t")


@pytest.mark.parametrize("moments", ["fp32", "bf16", "q8"])
def test_moment_layouts(moments):
    params = _params(dtype=torch.float32)
    slot = init_moment(params, moments, "t")
    check_moment(slot, params, moments, "state.exp_avg", "t")
    if moments == "q8":
        assert isinstance(slot, Q8Moment)
        assert slot.codes["emb"].dtype == torch.uint8 and slot.absmax["emb"].shape == (8192 // Q8_BLOCK,)
        assert slot.codes["odd"].dtype == torch.float32 and slot.absmax["odd"].shape == (0,)
        assert slot.codes["small"].dtype == torch.float32
    else:
        want = torch.bfloat16 if moments == "bf16" else torch.float32
        assert all(v.dtype == want for v in slot.values())
    assert all(bool((v == 0).all()) for v in decode_moment(slot, True))
    # fp64 params keep fp64 moments in every setting
    f64 = init_moment({"d": torch.ones(8192, dtype=torch.float64)}, moments, "t")
    leaf = f64.codes["d"] if moments == "q8" else f64["d"]
    assert leaf.dtype == torch.float64


def test_moment_encode_decode_matches_lowbits_and_checkpoints():
    params = _params(dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    keys = sorted(params)  # the trees' leaf order (optree sorts a dict's keys)
    values = [torch.randn(params[k].shape, generator=g) for k in keys]
    slot = encode_moment(values, init_moment(params, "q8", "t"), signed=True)
    codes, absmax = quantize_q8(values[keys.index("w")], True)
    assert _same_bits(slot.codes["w"], codes) and _same_bits(slot.absmax["w"], absmax)
    dec = decode_moment(slot, True)
    assert _same_bits(dec[keys.index("w")], dequantize_q8(codes, absmax, True))
    for k in ("odd", "small", "ln"):  # kept fp32, exactly
        assert _same_bits(dec[keys.index(k)], values[keys.index(k)])
    loaded = _roundtrip(slot)
    assert isinstance(loaded, Q8Moment) and all(_same_bits(a, b) for a, b in zip(decode_moment(loaded, True), dec))
    b16 = encode_moment(values, init_moment(params, "bf16", "t"), signed=True)
    assert all(_same_bits(b16[k], v.to(torch.bfloat16)) for k, v in zip(keys, values))


def test_moment_refusals_name_the_setting_and_leaf():
    params = _params(dtype=torch.float32)
    q8 = init_moment(params, "q8", "t")
    with pytest.raises(ValueError, match="made with moments='q8'"):
        check_moment(q8, params, "fp32", "state.inner.exp_avg", "t")
    with pytest.raises(TypeError, match="not the Q8Moment"):
        check_moment(init_moment(params, "fp32", "t"), params, "q8", "state.inner.exp_avg", "t")
    with pytest.raises(ValueError, match="exp_avg leaf 'emb' is torch.float32"):
        check_moment(init_moment(params, "fp32", "t"), params, "bf16", "state.inner.exp_avg", "t")
    with pytest.raises(ValueError, match="moments must be one of"):
        init_moment(params, "int8", "t")
    with pytest.raises(TypeError, match="'i'"):
        init_moment({"i": torch.ones(4096, dtype=torch.int32)}, "q8", "t")


def test_bytes_per_parameter_from_storage():
    n = 1 << 20
    params = {"w": torch.zeros(n, dtype=torch.bfloat16), "ln": torch.zeros(256)}
    total = sum(t.numel() for t in params.values())
    fp32_master = {k: v.float() for k, v in params.items()}
    today = storage_bytes(params, fp32_master, init_moment(params, "fp32", "t"), init_moment(params, "fp32", "t"))
    split = storage_bytes(params, init_split_master(params, "t"), init_moment(params, "fp32", "t"),
                          init_moment(params, "fp32", "t"))
    lowmem = storage_bytes(params, init_split_master(params, "t"), init_moment(params, "q8", "t"),
                           init_moment(params, "q8", "t"))
    assert 13.9 < today / total < 14.1
    assert 11.9 < split / total < 12.1
    assert lowmem / total <= 6.1


# ----------------------------------------------------------------------------------------------
# The reference step: torch.optim.AdamW on the rebuilt fp32 numbers, stored back
# ----------------------------------------------------------------------------------------------


def reference_adamw_steps(master32, grads_seq, *, moments, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=1e-2, split=False):
    """Steps of torch.optim.AdamW (single tensor, CPU) on one fp32 tensor whose moments are
    stored per ``moments`` ("fp32", "bf16", "q8" when eligible) and whose master is stored
    split (bf16 + int16) when ``split``. Returns the stored master (fp32) and moments after
    each step."""
    if split:
        hi, lo = split_bf16(master32)
    p = torch.nn.Parameter(master32.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    m_store = v_store = None
    out = []
    for t, g in enumerate(grads_seq, start=1):
        with torch.no_grad():
            if split:
                p.copy_(join_bf16(hi, lo))
            if t > 1:
                st = opt.state[p]
                if moments == "q8":
                    st["exp_avg"].copy_(dequantize_q8(*m_store, True))
                    st["exp_avg_sq"].copy_(dequantize_q8(*v_store, False))
                elif moments == "bf16":
                    st["exp_avg"].copy_(m_store.float())
                    st["exp_avg_sq"].copy_(v_store.float())
        p.grad = g.float().clone()
        opt.step()
        with torch.no_grad():
            st = opt.state[p]
            if moments == "q8":
                m_store, v_store = quantize_q8(st["exp_avg"], True), quantize_q8(st["exp_avg_sq"], False)
            elif moments == "bf16":
                m_store, v_store = st["exp_avg"].to(torch.bfloat16), st["exp_avg_sq"].to(torch.bfloat16)
            else:
                m_store, v_store = st["exp_avg"].clone(), st["exp_avg_sq"].clone()
            if split:
                hi, lo = split_bf16(p.detach())
            out.append((p.detach().clone(), m_store, v_store))
    return out


@pytest.mark.parametrize("moments", ["fp32", "bf16", "q8"])
def test_split_master_is_the_fp32_master_bit_for_bit(moments):
    # The design's claim at the reference level: with the same gradients, keeping the master
    # split changes nothing about the fp32 master (the join is exact), whatever the moments.
    g = torch.Generator().manual_seed(2)
    master = torch.randn(4096, generator=g).to(torch.bfloat16).float()
    grads = [torch.randn(4096, generator=g) for _ in range(20)]
    a = reference_adamw_steps(master, grads, moments=moments, split=False)
    b = reference_adamw_steps(master, grads, moments=moments, split=True)
    for (pa, _, _), (pb, _, _) in zip(a, b):
        assert _same_bits(pa, pb)
    # and the bf16 params (the high halves) are the fp32 masters' casts except at exact ties
    hi, _ = split_bf16(a[-1][0])
    cast = a[-1][0].to(torch.bfloat16)
    tie = (a[-1][0].view(torch.int32) & 0xFFFF) == 0x8000
    assert bool(((hi.view(torch.int16) == cast.view(torch.int16)) | tie).all())


def test_q8_moments_track_fp32_moments():
    # 8-bit moments are an approximation: after 20 steps the trajectory stays close to fp32's
    g = torch.Generator().manual_seed(3)
    master = torch.randn(8192, generator=g)
    grads = [torch.randn(8192, generator=g) * 0.1 for _ in range(20)]
    full = reference_adamw_steps(master, grads, moments="fp32")[-1][0]
    q8 = reference_adamw_steps(master, grads, moments="q8")[-1][0]
    b16 = reference_adamw_steps(master, grads, moments="bf16")[-1][0]
    moved = (full - master).abs().mean()
    assert float((q8 - full).abs().mean()) < 0.05 * float(moved)
    assert float((b16 - full).abs().mean()) < 0.02 * float(moved)
