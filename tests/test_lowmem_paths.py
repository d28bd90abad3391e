"""The low-memory settings on every path: ``master="split"`` and ``moments="bf16"|"q8"``.

Exactness: with the same gradients, ``master="split"`` keeps the fp32 master that
``master="fp32"`` keeps, bit for bit, pure and in place, and the bf16 params differ only at exact
ties. Composition: a skipped step changes no bit of params or state (codes included), clipping,
accumulation, checkpoints that resume bit for bit, ``make_train_step`` (eager and
``torch.compile(fullgraph=True)``), ``ModuleTrainer``. Bad inputs are refused by name before any
write. Bytes per parameter are counted from the tensors' storages.
"""

import io

import pytest
import torch
import torch.nn as nn

import ampfunc as af
from _helpers import clone_tree, same_tree_bits
from ampfunc.lowmem import Q8Moment, SplitMaster, storage_bytes


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(32, 256, generator=g).to(torch.bfloat16),   # q8 (32 blocks)
            "w": torch.randn(64, 80, generator=g).to(torch.bfloat16),      # 5120: q8
            "b": torch.randn(80, generator=g).to(torch.bfloat16),          # small: fp32 moments
            "ln": torch.randn(80, generator=g)}                            # fp32: its own master


def _grads(params, seed, scale=1.0, dtype=None):
    g = torch.Generator().manual_seed(1000 + seed)
    return {k: (torch.randn(v.shape, generator=g) * scale).to(dtype or v.dtype) for k, v in params.items()}


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.dtype.is_floating_point \
        else t


def _tx(master, moments="fp32", **kw):
    inner = af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-2, weight_decay=0.1, moments=moments))
    return af.mixed_precision(inner, af.DynamicLossScale(2.0 ** 4, growth_interval=3), master=master, **kw)


def _take_step(tx, path, params, grads, state):
    """One step of ``tx`` by ``path``: "update" (+ apply_updates), "step" (pure) or "step_"."""
    if path == "update":
        updates, state = tx.update(grads, state, params)
        return af.apply_updates(params, updates), state
    return getattr(tx, path)(params, grads, state)


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "in_place"])
def test_split_master_equals_the_fp32_master_bit_for_bit(inplace):
    params = _params()
    a, b = _tx("fp32"), _tx("split")
    pa, pb = clone_tree(params), clone_tree(params)
    sa, sb = a.init(pa), b.init(pb)
    assert isinstance(sb.master, SplitMaster)
    ties = 0
    for i in range(20):
        grads = _grads(params, i, scale=16.0)
        if i == 7:
            grads["w"][0, 0] = float("inf")  # a skipped step on both sides
        step_a, step_b = (a.step_, b.step_) if inplace else (a.step, b.step)
        pa, sa = step_a(pa, clone_tree(grads), sa)
        pb, sb = step_b(pb, clone_tree(grads), sb)
        ma, mb = sa.master, af.master_params(pb, sb)
        assert same_tree_bits(ma, mb), f"step {i}"
        for k in params:
            if pa[k].dtype == torch.bfloat16:
                differ = _bits(pa[k]) != _bits(pb[k])
                tie = (_bits(ma[k]) & 0xFFFF) == 0x8000
                assert bool((tie | ~differ).all()), f"step {i}, leaf {k}"
                ties += int(differ.sum())
            else:
                assert same_tree_bits(pa[k], pb[k])
        assert same_tree_bits(sa.inner, sb.inner) and same_tree_bits(sa.loss_scale, sb.loss_scale)
    assert int(sb.skipped) == 1


def test_master_params_for_every_setting():
    params = _params()
    for master in ("fp32", "split"):
        tx = _tx(master)
        state = tx.init(params)
        m = af.master_params(params, state)
        assert all(v.dtype == torch.float32 for v in m.values())
        assert all(bool((m[k] == params[k].float()).all()) for k in params)
    f32 = {k: v.float() for k, v in params.items()}
    state = _tx("fp32").init(f32)
    assert af.master_params(f32, state) is f32  # fp32 params are their own masters


def test_master_params_refuses_what_is_not_a_mixed_precision_state_and_masters_of_other_params():
    params = _params()
    split_state = _tx("split").init(params)
    for bad, why in [(None, "NoneType"), (af.adamw(1e-3).init(params), "keeps no master"),
                     (split_state.master, "not its .master"), ({"master": 1}, "got dict")]:
        with pytest.raises(TypeError, match=why):
            af.master_params(params, bad)
    other = dict(params, w=torch.zeros(64, 81, dtype=torch.bfloat16))
    for master in ("fp32", "split"):
        with pytest.raises(ValueError, match="'w'"):
            af.master_params(other, _tx(master).init(params))
        with pytest.raises(ValueError, match="other params"):
            af.master_params({k: params[k] for k in ("b", "emb")}, _tx(master).init(params))
    model = nn.Linear(8, 8).to(torch.bfloat16)
    flat = af.ModuleTrainer(model, af.adamw(1e-3), flat=True)
    with pytest.raises(ValueError, match="flat buffers"):
        af.master_params(af.params_of(model), flat.state)


@pytest.mark.parametrize("moments", ["bf16", "q8"])
@pytest.mark.parametrize("master", ["fp32", "split"])
def test_low_precision_moments_match_the_reference(master, moments):
    # the reference: decode the moments, run the fp32 step, encode them again
    from ampfunc.lowmem import decode_moment, encode_moment

    params = _params()
    low, full = _tx(master, moments), _tx(master, "fp32")
    p_low, s_low = clone_tree(params), low.init(clone_tree(params))
    for i in range(5):
        grads = _grads(params, i, scale=16.0)
        adam_low = s_low.inner[1]
        ref_state = s_low._replace(inner=(s_low.inner[0], adam_low._replace(
            exp_avg=dict(zip(sorted(params), decode_moment(adam_low.exp_avg, True))),
            exp_avg_sq=dict(zip(sorted(params), decode_moment(adam_low.exp_avg_sq, False))))))
        p_ref, s_ref = full.step(clone_tree(p_low), clone_tree(grads), clone_tree(ref_state))
        p_low, s_low = low.step_(p_low, grads, s_low)
        adam_ref, adam_new = s_ref.inner[1], s_low.inner[1]
        keys = sorted(params)
        want_m = encode_moment([adam_ref.exp_avg[k] for k in keys], adam_new.exp_avg, True)
        want_v = encode_moment([adam_ref.exp_avg_sq[k] for k in keys], adam_new.exp_avg_sq, False)
        assert same_tree_bits(want_m, adam_new.exp_avg) and same_tree_bits(want_v, adam_new.exp_avg_sq), f"step {i}"
        assert same_tree_bits(p_ref, p_low)
        assert same_tree_bits(af.master_params(p_ref, s_ref), af.master_params(p_low, s_low))
    if moments == "q8":
        assert isinstance(s_low.inner[1].exp_avg, Q8Moment)
        assert s_low.inner[1].exp_avg.codes["emb"].dtype == torch.uint8


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "in_place"])
def test_a_skipped_step_changes_no_bit(inplace):
    params = _params()
    tx = _tx("split", "q8")
    p, s = clone_tree(params), tx.init(clone_tree(params))
    for i in range(3):
        p, s = tx.step_(p, _grads(params, i, scale=16.0), s)
    before_p, before_s = clone_tree(p), clone_tree(s)
    bad = _grads(params, 9, scale=16.0)
    bad["emb"][3, 3] = float("nan")
    p2, s2 = (tx.step_ if inplace else tx.step)(p, bad, s)
    assert not bool(s2.finite)
    assert same_tree_bits(p2, before_p)
    assert same_tree_bits((s2.master, s2.inner), (before_s.master, before_s.inner))


def test_bytes_per_parameter_from_storage():
    n_params = 1 << 20
    params = {"w": torch.zeros(1024, 1024, dtype=torch.bfloat16), "ln": torch.zeros(1024)}
    total = sum(v.numel() for v in params.values())
    per = {}
    for name, master, moments in (("today", "fp32", "fp32"), ("split", "split", "fp32"), ("lowmem", "split", "q8")):
        tx = af.mixed_precision(af.adamw(1e-3, moments=moments), af.NoOpLossScale(), master=master)
        state = tx.init(params)
        per[name] = storage_bytes(params, state.master, state.inner) / total
    assert n_params <= total
    assert 13.9 < per["today"] < 14.1 and 11.9 < per["split"] < 12.1 and per["lowmem"] <= 6.1, per


def test_checkpoint_resumes_bit_for_bit():
    params = _params()
    tx = _tx("split", "q8")
    p, s = clone_tree(params), tx.init(clone_tree(params))
    for i in range(3):
        p, s = tx.step_(p, _grads(params, i, scale=16.0), s)
    buf = io.BytesIO()
    torch.save((p, s), buf)
    buf.seek(0)
    p2, s2 = torch.load(buf, weights_only=True)
    assert isinstance(s2.master, SplitMaster) and isinstance(s2.inner[1].exp_avg, Q8Moment)
    for i in range(3, 6):
        p, s = tx.step_(p, _grads(params, i, scale=16.0), s)
        p2, s2 = tx.step_(p2, _grads(params, i, scale=16.0), s2)
    assert same_tree_bits(p, p2) and same_tree_bits(s, s2)


def test_accumulate_composes():
    params = _params()
    inner = af.accumulate(af.adamw(1e-2, moments="q8"), 2)
    tx = af.mixed_precision(inner, af.NoOpLossScale(), master="split")
    p, s = clone_tree(params), tx.init(clone_tree(params))
    for i in range(4):
        p, s = tx.step(p, _grads(params, i, dtype=torch.float32), s)
    moved = af.master_params(p, s)
    assert not same_tree_bits(moved, {k: v.float() for k, v in params.items()})


def test_bad_inputs_are_refused_by_name_before_any_write():
    with pytest.raises(ValueError, match="'h' is float16"):
        af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale(), master="split").init(
            {"h": torch.ones(2, dtype=torch.float16)})
    with pytest.raises(ValueError, match="master must be one of"):
        af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale(), master="int16")
    with pytest.raises(ValueError, match="master='split'.*float32"):
        af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale(), torch.float64, master="split")
    with pytest.raises(ValueError, match="moments must be one of"):
        af.adamw(1e-3, moments="int8")
    with pytest.raises(TypeError, match="'i'"):
        af.adamw(1e-3, moments="q8").init({"i": torch.ones(4096, dtype=torch.int32)})
    params = _params()
    # a state from another setting: made with master="fp32" (or moments="fp32"), stepped as split / q8
    for made, used, what in ((_tx("fp32"), _tx("split"), "SplitMaster"), (_tx("split", "fp32"), _tx("split", "q8"),
                                                                         "Q8Moment")):
        state = made.init(clone_tree(params))
        p = clone_tree(params)
        snapshot_p, snapshot_s = clone_tree(p), clone_tree(state)
        for step in (used.step, used.step_):
            with pytest.raises((ValueError, TypeError), match=what):
                step(p, _grads(params, 0), state)
            assert same_tree_bits(p, snapshot_p) and same_tree_bits(state, snapshot_s)


def _model(seed=0, d=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 2 * d), nn.LayerNorm(2 * d), nn.Linear(2 * d, d))


def _loss(fwd, x, y):
    return torch.nn.functional.mse_loss(fwd(x), y)


TIE = -32768  # the int16 remainder of a master whose low 16 bits are 0x8000 (an exact bf16 tie)


def _split_and_reference(seed, d):
    """``make_train_step`` with ``"p=bf16"`` + ``master="split"``, and the ``"p=f32,c=bf16"``
    run from the same values (the bf16 params' fp32 values), with their initial states."""
    rounded = _model(seed, d)
    with torch.no_grad():
        for m in (rounded[0], rounded[2]):
            for t in m.parameters():
                t.copy_(t.to(torch.bfloat16))
    ref = af.make_train_step(rounded, _loss, af.adamw(1e-2), "p=f32,c=bf16,o=f32")
    low = af.make_train_step(_model(seed, d), _loss, af.adamw(1e-2), "p=bf16,c=bf16,o=f32", master="split")
    return ref, low, ref.init(), low.init()


def _ties(state):
    return sum(int((r == TIE).sum()) for r in state.master.remainder.values())


def test_make_train_step_split_one_step_from_equal_states():
    # From equal states the two forwards are the same (the bf16 params are the fp32 params'
    # exact values), so are the gradients and the fp32 Adam step: the masters are equal bit for
    # bit. The split's bf16 param is its master rounded to nearest with ties away from zero, the
    # reference's compute copy is `.to(torch.bfloat16)` (ties to even): they may differ only
    # where the master's low 16 bits are exactly 0x8000.
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    ref, low, s_ref, s_low = _split_and_reference(0, 64)
    assert isinstance(s_low.master, SplitMaster)
    assert s_low.params["0.weight"].dtype == torch.bfloat16 and s_low.params["1.weight"].dtype == torch.float32
    assert storage_bytes(s_low.params, s_low.master) == storage_bytes(s_ref.params)
    s_ref, _ = ref.step_(s_ref, x, y)
    s_low, out = low.step_(s_low, x, y)
    assert bool(out.finite)
    masters = af.master_params(s_low.params, s_low)
    assert masters["1.weight"] is s_low.params["1.weight"]  # fp32 leaves are their own masters
    assert same_tree_bits(masters, s_ref.params)
    differ = 0
    for k, p in s_low.params.items():
        if p.dtype == torch.bfloat16:
            tie = (_bits(masters[k]) & 0xFFFF) == 0x8000
            parted = _bits(p) != _bits(s_ref.params[k].to(torch.bfloat16))
            assert bool((tie | ~parted).all()), k
            differ += int(parted.sum())
    # This seed's first step meets a tie whose truncation is even: the one element where the
    # two roundings part (and from which the runs part on the next forward).
    assert _ties(s_low) >= 1 and differ >= 1


def test_make_train_step_split_equals_the_fp32_run_bit_for_bit_while_no_tie_is_met():
    # 20 steps of "p=bf16" + master="split" against "p=f32,c=bf16": as long as no master sits on
    # an exact tie, the bf16 params are the fp32 params' `.to(torch.bfloat16)`, the forwards are
    # the same, and the masters stay equal bit for bit. The precondition is checked each step.
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    ref, low, s_ref, s_low = _split_and_reference(2, 16)
    for i in range(20):
        s_ref, _ = ref.step_(s_ref, x, y)
        s_low, out = low.step_(s_low, x, y)
        assert bool(out.finite)
        assert _ties(s_low) == 0, f"step {i}: this seed meets a tie; the comparison needs a run without one"
        masters = af.master_params(s_low.params, s_low)
        assert same_tree_bits(masters, s_ref.params), f"step {i}"
        for k, p in s_low.params.items():
            if p.dtype == torch.bfloat16:
                assert same_tree_bits(p, s_ref.params[k].to(torch.bfloat16)), f"step {i}, {k}"


@pytest.mark.slow
def test_compiled_step_is_one_graph_and_gives_the_eager_numbers():
    # torch.compile(fullgraph=True) of the split + q8 step on given gradients: one graph, the
    # eager step's bits (the same kernels and the same plain-torch encodings), in place.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    params = _params()
    tx = _tx("split", "q8")
    p_e, s_e = clone_tree(params), tx.init(clone_tree(params))
    p_c, s_c = clone_tree(params), tx.init(clone_tree(params))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(tx.step_, fullgraph=True, backend=counter)
    for i in range(3):
        grads = _grads(params, i, scale=16.0)
        p_e, s_e = tx.step_(p_e, clone_tree(grads), s_e)
        p_c, s_c = compiled(p_c, clone_tree(grads), s_c)
    assert counter.frame_count == 1
    assert same_tree_bits(p_e, p_c) and same_tree_bits(s_e, s_c)


@pytest.mark.slow
def test_make_train_step_split_compiles_fullgraph():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    train = af.make_train_step(_model(), _loss, af.adamw(1e-2, moments="q8"), "p=bf16,c=bf16,o=f32",
                               master="split")
    eager_state, compiled_state = train.init(), train.init()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(train.step_, fullgraph=True, backend=counter)
    for _ in range(2):
        eager_state, _ = train.step_(eager_state, x, y)
        compiled_state, out = compiled(compiled_state, x, y)
        assert bool(out.finite)
    assert counter.frame_count == 1
    assert isinstance(compiled_state.master, SplitMaster)
    # the compiled forward rounds its bf16 matmuls its own way: the masters agree closely
    me = af.master_params(eager_state.params, eager_state)
    mc = af.master_params(compiled_state.params, compiled_state)
    for k in me:
        assert torch.allclose(me[k], mc[k], atol=1e-3, rtol=0), k


def test_module_trainer_split():
    model = _model().to(torch.bfloat16)
    model[1].float()
    trainer = af.ModuleTrainer(model, af.adamw(1e-2, moments="q8"), master="split")
    assert isinstance(trainer.state.master, SplitMaster)
    w0 = model[0].weight.detach().clone()
    for _ in range(2):
        x = torch.randn(16, 64, dtype=torch.bfloat16)
        out = model[2](model[1](model[0](x).float()).to(torch.bfloat16))
        trainer.scale(out.float().square().mean()).backward()
        assert bool(trainer.step())
    assert not same_tree_bits(w0, model[0].weight.detach())
    masters = af.master_params(dict(model.named_parameters()), trainer.state)
    assert masters["0.weight"].dtype == torch.float32
    assert bool((masters["0.weight"].to(torch.bfloat16) == model[0].weight.detach()).float().mean() > 0.99)


def test_the_advisor_recommends_the_low_memory_setting_where_memory_is_the_constraint():
    gib = 2 ** 30
    tight = af.recommend_policy("cuda", capability=(8, 0), n_params=7 * 10 ** 9, device_memory=80 * gib)
    assert (tight.master, tight.moments, str(tight.policy)) == ("split", "q8", "p=bf16,c=bf16,o=f32")
    assert "Memory is the constraint" in tight.reason and "91.3 GiB" in tight.reason
    masters = [r for r in tight.requirements if r.startswith("fp32 master weights")]
    assert len(masters) == 1 and "kept split, 13351 MiB of int16" in masters[0]  # not a 4-byte copy
    roomy = af.recommend_policy("cuda", capability=(8, 0), n_params=10 ** 9, device_memory=80 * gib)
    assert (roomy.master, roomy.moments) == ("fp32", "fp32") and "Memory" not in roomy.reason
    hopeless = af.recommend_policy("cuda", capability=(8, 0), n_params=20 * 10 ** 9, device_memory=80 * gib)
    assert hopeless.master == "fp32"  # even 6.1 bytes per parameter would not fit: no false promise
    fp32_cpu = af.recommend_policy("cpu", cpu_flags=[], n_params=10 ** 9, device_memory=8 * gib)
    assert fp32_cpu.master == "fp32"  # no bf16 on this CPU: the split master does not apply


def test_the_main_jobs_have_the_low_memory_rows():
    from ampfunc.examples.common import CONFIGS, parse_configs

    assert parse_configs("bf16-split,bf16_lowmem") == ["bf16-split", "bf16-lowmem"]
    assert (CONFIGS["bf16-split"].master, CONFIGS["bf16-split"].moments) == ("split", "fp32")
    assert (CONFIGS["bf16-lowmem"].master, CONFIGS["bf16-lowmem"].moments) == ("split", "q8")


def test_fused_step_refuses_a_state_made_with_other_moments_before_any_write():
    # moments="fp32" with a split master: the fused pass would read q8/bf16 moments as they are.
    p = {"w": torch.randn(4096).bfloat16(), "v": torch.randn(8)}
    g = {"w": torch.randn(4096).bfloat16(), "v": torch.randn(8)}
    fp32_moments = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale(), master="split")
    for made in ("q8", "bf16"):
        state = af.mixed_precision(af.adamw(1e-3, moments=made), af.NoOpLossScale(), master="split").init(p)
        snapshot_p, snapshot_s = clone_tree(p), clone_tree(state)
        with pytest.raises(ValueError, match="state.inner.exp_avg"):
            fp32_moments.step_(p, g, state)
        assert same_tree_bits(p, snapshot_p) and same_tree_bits(state, snapshot_s)


@pytest.mark.parametrize("master", ["fp32", "split"])
@pytest.mark.parametrize("path", ["update", "step", "step_"])
def test_a_q8_state_given_to_fp32_moments_is_refused_naming_the_setting(master, path):
    p = {"w": torch.randn(64, 64).bfloat16()}
    g = {"w": torch.randn(64, 64).bfloat16()}
    state = af.mixed_precision(af.adamw(1e-3, moments="q8"), af.NoOpLossScale(), master=master).init(p)
    tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale(), master=master)
    snapshot_p, snapshot_s = clone_tree(p), clone_tree(state)
    with pytest.raises(ValueError, match=r"state.inner.exp_avg is a Q8Moment but moments='fp32': the state was "
                                         r"made with moments='q8'"):
        tx.update(g, state, p) if path == "update" else getattr(tx, path)(p, g, state)
    assert same_tree_bits(p, snapshot_p) and same_tree_bits(state, snapshot_s)


@pytest.mark.parametrize("path", ["update", "step", "step_"])
def test_a_bf16_moment_state_given_to_fp32_moments_is_refused_naming_the_setting(path):
    p = {"w": torch.randn(64, 64).bfloat16()}
    g = {"w": torch.randn(64, 64).bfloat16()}
    state = af.mixed_precision(af.adamw(1e-3, moments="bf16"), af.NoOpLossScale()).init(p)
    tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale())
    snapshot_p, snapshot_s = clone_tree(p), clone_tree(state)
    with pytest.raises(ValueError, match=r"state.inner.exp_avg leaf 'w' is torch.bfloat16 \(64, 64\), but "
                                         r"moments='fp32' keeps torch.float32"):
        tx.update(g, state, p) if path == "update" else getattr(tx, path)(p, g, state)
    assert same_tree_bits(p, snapshot_p) and same_tree_bits(state, snapshot_s)


def test_split_step_refuses_aliased_params_naming_them():
    # Two leaves of one tensor would each pair their low half with the other's high half.
    shared = torch.randn(4096).bfloat16()
    p = {"a": shared, "b": shared}
    tx = af.mixed_precision(af.adamw(1e-3), af.NoOpLossScale(), master="split")
    state = tx.init(p)
    snapshot = shared.clone()
    with pytest.raises(ValueError, match="'a' and params leaf 'b'"):
        tx.step_(p, {"a": torch.randn(4096).bfloat16(), "b": torch.randn(4096).bfloat16()}, state)
    assert torch.equal(shared, snapshot)


def test_a_strided_remainder_takes_the_same_step_in_place_as_pure():
    # A state edited by hand (a transposed view of a contiguous copy): the in-place step gives
    # the pure step's bits (the fused kernel takes contiguous tensors; the plain path serves it).
    params = _params()
    tx = _tx("split", "q8")
    state = tx.init(params)
    strided = {k: (r.t().contiguous().t() if r.dim() == 2 else r) for k, r in state.master.remainder.items()}
    state = state._replace(master=SplitMaster(strided))
    assert not state.master.remainder["w"].is_contiguous()
    grads = _grads(params, 0)
    pure_params, pure_state = tx.step(clone_tree(params), grads, clone_tree(state))
    inplace_params, inplace_state = clone_tree(params), clone_tree(state)
    inplace_params, inplace_state = tx.step_(inplace_params, grads, inplace_state)
    assert same_tree_bits(pure_params, inplace_params)
    assert same_tree_bits(pure_state.master, inplace_state.master)
    assert same_tree_bits(pure_state.inner, inplace_state.inner)


@pytest.mark.parametrize("path", ["update", "step", "step_"])
@pytest.mark.parametrize("moments", ["q8", "bf16"])
def test_a_moment_that_overflows_stays_in_its_leaf_and_is_named_by_moment_overflows(path, moments):
    # A finite gradient of 1e30 squares past fp32's max in an applied step. As with fp32 moments,
    # that element stops moving and the monitor names the param; nothing turns NaN (in q8, the
    # block's absmax is inf and 0 * inf must not reach the 255 neighbours).
    params = _params()
    tx = af.mixed_precision(af.adamw(1e-2, moments=moments), af.NoOpLossScale(), master="split")
    state = tx.init(params)
    for i in range(3):
        grads = _grads(params, i)
        if i == 1:
            grads["w"][3, 5] = 1e30
        params, state = _take_step(tx, path, params, grads, state)
        if i == 1:
            frozen = params["w"][3, 5].clone()
    for name, p in params.items():
        assert not bool(p.float().isnan().any()), name
    assert params["w"][3, 5] == frozen
    assert af.monitor.moment_overflows(state) == ["w"]


def test_module_trainer_refuses_a_state_of_another_moments_setting_naming_it():
    model = nn.Linear(64, 64).bfloat16()
    q8 = af.ModuleTrainer(model, af.adamw(1e-3, moments="q8"), master="split")
    fp32 = af.ModuleTrainer(model, af.adamw(1e-3), master="split")
    before = clone_tree(fp32.state)
    with pytest.raises(ValueError, match=r"opt_state.exp_avg is a Q8Moment \(moments='q8'\) but this trainer's is "
                                         r"per-param tensors"):
        fp32.state = q8.state
    assert same_tree_bits(fp32.state, before)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_storage_bytes_counts_the_parts_of_a_sparse_tensor():
    dense = torch.eye(3)
    coo, csr = dense.to_sparse(), dense.to_sparse_csr()
    assert storage_bytes({"s": coo}) == 3 * 2 * 8 + 3 * 4       # int64 indices (2, 3) + 3 fp32 values
    parts = (csr.crow_indices(), csr.col_indices(), csr.values())  # torch may allocate them larger
    assert storage_bytes({"s": csr}) == sum(p.untyped_storage().nbytes() for p in parts) >= 4 * 8 + 3 * 8 + 3 * 4
    assert storage_bytes({"m": torch.empty(5, device="meta")}) == 0


@pytest.mark.parametrize("path", ["update", "step", "step_"])
def test_a_q8_second_moment_far_below_its_blocks_largest_never_makes_an_update_of_m_over_eps(path):
    # Each block of 256 holds four gradients of 1.0 and 252 of 1e-4; then the small ones vanish (a
    # dead ReLU). Their second moments (1e-11 against 1e-3 of the block's largest) are below the
    # unsigned map's smallest entry: decoded as 0 they made the next update m / eps (4.2 at
    # lr=1e-3). Kept at that entry, every move stays within Adam's lr, as with fp32 moments.
    lr = 1e-3
    params = {"w": torch.zeros(64, 64, dtype=torch.bfloat16)}
    tx = af.mixed_precision(af.adamw(lr, weight_decay=0.0, moments="q8"), af.NoOpLossScale(), master="split")
    state = tx.init(params)
    assert isinstance(state.inner.exp_avg_sq, Q8Moment)
    first = torch.full((64, 64), 1e-4)
    first[:, 0] = 1.0
    later = torch.zeros(64, 64)
    later[:, 0] = 1.0
    for grads in (first, later, later):
        before = af.master_params(params, state)["w"].clone()
        g = {"w": grads.bfloat16()}
        params, state = _take_step(tx, path, params, g, state)
        moved = (af.master_params(params, state)["w"] - before).abs().max().item()
        assert moved <= 1.01 * lr, moved
