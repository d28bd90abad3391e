"""The low-bit encodings of ampfunc.lowbits, against their definitions.

Split masters: ``join(split(x)) == x`` bit for bit for every non-NaN fp32 pattern (hypothesis
over raw bit patterns, biased to ties, signed zeros, subnormals and the largest exponents; and a
sweep over the whole 32-bit space at a prime stride), ``hi`` equal to torch's own
round-to-nearest-even cast except at exact ties with an even truncation (then one ulp away from
zero), NaN in, NaN out. q8: the map's construction, and codes against an independent float64
nearest-value search on the same map.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampfunc.lowbits import (
    Q8_BLOCK,
    dequantize_q8,
    dynamic_map,
    join_bf16,
    map_midpoints,
    q8_eligible,
    quantize_q8,
    split_bf16,
)


def _as_int32(u):
    """A Python int in [0, 2**32) as the int32 with those bits."""
    return u - 2 ** 32 if u >= 2 ** 31 else u


def _f32(bits: list) -> torch.Tensor:
    return torch.tensor([_as_int32(b) for b in bits], dtype=torch.int32).view(torch.float32)


_U16 = st.integers(0, 0xFFFF)
# High halves that matter: signed zeros, the subnormal range, 1.0's neighbourhood, the largest
# finite exponents and the inf/NaN exponent, either sign.
_HIGH = st.one_of(
    _U16,
    st.sampled_from([0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x3F7F, 0x7F7E, 0x7F7F, 0x7F80, 0x7FC0, 0x7FFF]),
    st.integers(0x0000, 0x00FF),  # subnormals and the smallest normals
    st.integers(0x7F00, 0x7FFF),  # largest exponents, inf, NaN
).flatmap(lambda h: st.sampled_from([h, h | 0x8000]))
# Low halves: ties, their neighbours, zero, and anything.
_LOW = st.one_of(_U16, st.sampled_from([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]))
_PATTERN = st.builds(lambda h, lo: (h << 16) | lo, _HIGH, _LOW)


def _check_split(bits: list) -> None:
    x = _f32(bits)
    hi, lo = split_bf16(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16 and hi.shape == x.shape == lo.shape
    back = join_bf16(hi, lo)
    nan = torch.isnan(x)
    exact = back.view(torch.int32) == x.view(torch.int32)
    assert bool(exact[~nan].all()), [hex(b) for b, ok in zip(bits, exact.tolist()) if not ok][:5]
    assert bool(torch.isnan(back[nan]).all()) and bool(torch.isnan(hi[nan].float()).all())
    # hi is x rounded to nearest: torch's cast (ties to even) except at ties with an even
    # truncation, where the split goes one ulp away from zero.
    cast = x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    mine = hi.view(torch.int16).to(torch.int32) & 0xFFFF
    raw = torch.tensor([b & 0xFFFFFFFF for b in bits], dtype=torch.int64)
    tie = (raw & 0xFFFF) == 0x8000
    even = ((raw >> 16) & 1) == 0
    expected = torch.where(tie & even, ((raw >> 16) + 1) & 0xFFFF, cast.to(torch.int64))
    assert bool((mine.to(torch.int64) == expected)[~nan].all())
    # lo is the signed remainder: bits(x) - (bits(hi) << 16) as a 32-bit difference, in [-2**15, 2**15)
    rem = (raw - (mine.to(torch.int64) << 16)) % (1 << 32)
    rem = torch.where(rem >= (1 << 31), rem - (1 << 32), rem)
    assert bool((lo.to(torch.int64) == rem)[~nan].all())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_PATTERN, min_size=1, max_size=64))
def test_split_joins_back_bit_for_bit_and_hi_is_round_to_nearest(bits):
    _check_split(bits)


def test_split_edge_patterns():
    bits = [0x00000000, 0x80000000,                  # +0, -0
            0x00008000, 0x80008000, 0x00018000,      # ties at the bottom of the subnormals
            0x00007FFF, 0x007FFFFF, 0x00800000,      # subnormal / normal boundary
            0x3F808000, 0x3F818000, 0xBF808000,      # ties around 1.0 (even, odd truncation)
            0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,      # near FLT_MAX: the last one rounds to inf
            0xFF7F8000, 0x7F800000, 0xFF800000,      # -near max, +inf, -inf
            0x7F800001, 0x7FC00000, 0xFFFFFFFF, 0x7FFF8000, 0xFFFF8000]  # NaNs
    _check_split(bits)
    x = _f32(bits)
    hi, lo = split_bf16(x)
    assert hi[0].view(torch.int16).item() == 0 and hi[1].view(torch.int16).item() == -0x8000  # signs of zeros kept
    assert hi[3].item() < 0 and hi[2].item() > 0  # ties away from zero, either sign
    assert torch.isinf(hi[13].float()) and hi[13].item() > 0 and bool(torch.isfinite(join_bf16(hi, lo)[13]))
    assert join_bf16(hi, lo)[15].item() == float("inf") and lo[15].item() == 0


def test_split_sweep_over_the_32_bit_space():
    # every 65,521st pattern (a prime stride, so every low half and every high half is hit)
    step = 65521
    for start in range(0, 2 ** 32, 2 ** 30):
        raw = torch.arange(start, min(start + 2 ** 30, 2 ** 32), step, dtype=torch.int64)
        b = torch.where(raw >= 2 ** 31, raw - 2 ** 32, raw).to(torch.int32)
        x = b.view(torch.float32)
        hi, lo = split_bf16(x)
        nan = torch.isnan(x)
        assert bool((join_bf16(hi, lo).view(torch.int32) == b)[~nan].all())
        cast = x.to(torch.bfloat16).view(torch.int16)
        tie = (raw & 0xFFFF) == 0x8000
        assert bool(((hi.view(torch.int16) == cast) | tie | nan).all())


def test_split_refuses_other_dtypes_and_shapes():
    with pytest.raises(TypeError, match="float32"):
        split_bf16(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="int16"):
        join_bf16(torch.ones(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="shape"):
        join_bf16(torch.ones(2, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int16))


def test_split_of_a_non_contiguous_tensor():
    x = torch.randn(8, 6)[:, ::2]
    hi, lo = split_bf16(x)
    assert bool((join_bf16(hi, lo) == x).all())


# ----------------------------------------------------------------------------------------------
# q8
# ----------------------------------------------------------------------------------------------


def test_dynamic_maps_are_bitsandbytes_construction():
    for signed in (True, False):
        m = dynamic_map(signed)
        assert m.dtype == torch.float32 and m.numel() == 256
        assert bool((m[1:] > m[:-1]).all())
        assert m[-1].item() == 1.0 and 0.0 in m.tolist()
    s, u = dynamic_map(True), dynamic_map(False)
    assert (s < 0).sum().item() == 127 and (s > 0).sum().item() == 128
    assert u[0].item() == 0.0 and (u > 0).sum().item() == 255
    # decade 10**-6 first: the smallest positive signed value is the midpoint of [0.1, 1] * 1e-6
    assert s[128].item() == pytest.approx(0.55e-6, rel=1e-6)
    assert u[1].item() == pytest.approx(10 ** -6 * (0.1 + 0.55) / 2, rel=1e-6)
    # the signed map's positive half is the negation of the negative half (plus 1.0)
    assert s[127].item() == 0.0 and bool((s[128:255] == -s[:127].flip(0)).all())


def _nearest_code_f64(y: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """The nearest map entry in float64 (ties: the larger), by brute force."""
    d = (y.double()[:, None] - qmap.double()[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    idx = torch.arange(256).expand_as(d)
    return torch.where(d == best, idx, -1).max(dim=1).values


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.booleans(), st.sampled_from([1e-30, 1e-3, 1.0, 1e20]))
def test_q8_codes_are_the_nearest_map_entry(seed, signed, magnitude):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * Q8_BLOCK, generator=g) * magnitude
    x = x * torch.rand(4 * Q8_BLOCK, generator=g) ** 8  # many small values, like Adam's moments
    if not signed:
        x = x.abs()
    codes, absmax = quantize_q8(x, signed)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and absmax.shape == (4,)
    assert bool((absmax == x.reshape(4, -1).abs().amax(1)).all())
    qmap = dynamic_map(signed)
    y = (x.reshape(4, -1) * (1.0 / absmax)[:, None]).reshape(-1)  # the quantizer's scaling
    ref = _nearest_code_f64(y, qmap)
    if not signed:  # the unsigned map keeps positive values off the code of 0
        ref = torch.where((ref == 0) & (y > 0), torch.ones_like(ref), ref)
    mids = map_midpoints(signed)
    # the fp32 midpoints are the decision points: the float64 search agrees away from them
    near_mid = ((y[:, None] - mids[None, :]).abs() <= 2 * torch.finfo(torch.float32).eps * y.abs()[:, None]).any(1)
    agree = codes.to(torch.int64) == ref
    assert bool((agree | near_mid).all())
    # and the rule itself: code k means mid[k-1] <= y < mid[k]
    k = codes.to(torch.int64)
    floored = (k == 1) & (y > 0) & (y < mids[0]) if not signed else torch.zeros_like(y, dtype=torch.bool)
    lower_ok = torch.where(k > 0, (y >= mids[(k - 1).clamp(min=0)]) | floored, torch.ones_like(y, dtype=torch.bool))
    upper_ok = torch.where(k < 255, y < mids[k.clamp(max=254)], torch.ones_like(y, dtype=torch.bool))
    assert bool((lower_ok & upper_ok).all())
    back = dequantize_q8(codes, absmax, signed)
    assert bool((back == qmap[k] * absmax.repeat_interleave(Q8_BLOCK)).all())


def test_q8_ties_zero_blocks_extremes_and_nan():
    mids = map_midpoints(True)
    x = torch.zeros(2 * Q8_BLOCK)
    x[0] = 1.0                  # the block's absmax: code of 1.0
    x[1] = mids[200].item()     # exactly on a midpoint: the larger code
    x[2] = -1.0                 # -absmax: the most negative entry
    x[3] = -0.0
    x[Q8_BLOCK:] = 0.0          # a block of zeros: absmax 0, every value comes back 0
    codes, absmax = quantize_q8(x, signed=True)
    assert codes[0].item() == 255 and codes[1].item() == 201 and codes[2].item() == 0
    assert absmax.tolist() == [1.0, 0.0]
    back = dequantize_q8(codes, absmax, signed=True)
    assert back[0].item() == 1.0 and back[2].item() == dynamic_map(True)[0].item()
    assert bool((back[Q8_BLOCK:] == 0).all()) and back[3].item() == 0.0
    # NaN: the block's absmax is NaN, so the whole block comes back NaN (nothing silently finite)
    x[5] = float("nan")
    codes, absmax = quantize_q8(x, signed=True)
    assert torch.isnan(absmax[0]) and bool(torch.isnan(dequantize_q8(codes, absmax, True)[:Q8_BLOCK]).all())
    # unsigned: a (tiny negative rounding) value below zero takes code 0
    codes, _ = quantize_q8(torch.full((Q8_BLOCK,), -1e-30).index_fill(0, torch.tensor([0]), 1.0), signed=False)
    assert codes[1].item() == 0


def test_q8_an_infinity_keeps_its_sign_and_its_block_neighbours_come_back_zero_not_nan():
    # A second moment that overflowed: its block's absmax is inf. 0 * inf would be NaN and spread
    # the overflow to the 255 neighbours (and from them into the params).
    for signed in (True, False):
        x = torch.rand(2 * Q8_BLOCK) * 1e-3
        x[7] = float("inf")
        if signed:
            x[9] = float("-inf")
            x[10] = -0.5
        codes, absmax = quantize_q8(x, signed)
        assert absmax[0].item() == float("inf") and absmax[1].item() < 1e-3
        back = dequantize_q8(codes, absmax, signed)
        assert back[7].item() == float("inf")
        if signed:
            assert back[9].item() == float("-inf") and back[10].item() == 0.0
        assert not bool(back.isnan().any())
        finite = torch.ones(Q8_BLOCK, dtype=torch.bool)
        finite[[7, 9] if signed else [7]] = False
        assert bool((back[:Q8_BLOCK][finite] == 0).all())
        # the other block is untouched by its neighbour's overflow
        ref_codes, ref_absmax = quantize_q8(x[Q8_BLOCK:], signed)
        assert bool((codes[Q8_BLOCK:] == ref_codes).all()) and absmax[1] == ref_absmax[0]


def test_q8_a_positive_second_moment_never_decodes_as_zero():
    # The zero-point problem: v spans the square of m's range; a v decoded as 0 beside a nonzero m
    # makes the next update m / eps. Positive values below the first midpoint take code 1.
    x = torch.zeros(Q8_BLOCK)
    x[0] = 1.0
    x[1] = 1e-9         # far below the map's smallest entry (3.25e-7): code 1, an overestimate
    x[2] = 1e-45        # the smallest subnormal: still positive, still code 1
    x[3] = 0.0          # zero stays zero
    codes, absmax = quantize_q8(x, signed=False)
    assert codes[:4].tolist() == [255, 1, 1, 0]
    back = dequantize_q8(codes, absmax, signed=False)
    assert back[1].item() == dynamic_map(False)[1].item() and back[3].item() == 0.0
    signed_codes, _ = quantize_q8(x, signed=True)  # the signed map (first moments) keeps the nearest
    assert dynamic_map(True)[signed_codes[1].long()].item() == 0.0


def test_q8_largest_value_round_trips_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * Q8_BLOCK, generator=g) * 3
    codes, absmax = quantize_q8(x, True)
    back = dequantize_q8(codes, absmax, True).reshape(16, -1)
    i = x.reshape(16, -1).abs().argmax(1)
    pos = x.reshape(16, -1).gather(1, i[:, None]).squeeze(1) > 0
    got = back.gather(1, i[:, None]).squeeze(1)
    assert bool((got[pos] == absmax[pos]).all())


def test_q8_eligibility_and_refusals():
    assert q8_eligible(4096) and q8_eligible(256 * 100) and not q8_eligible(4095) and not q8_eligible(4096 + 128)
    assert not q8_eligible(256)
    with pytest.raises(ValueError, match="multiple of the block"):
        quantize_q8(torch.ones(300), True)
    with pytest.raises(TypeError, match="float32"):
        quantize_q8(torch.ones(256, dtype=torch.bfloat16), True)
    with pytest.raises(ValueError, match="absmax"):
        dequantize_q8(torch.zeros(512, dtype=torch.uint8), torch.ones(3), True)


def test_the_kernels_lookup_gives_the_searchsorted_codes():
    # the fused kernels' quantizer: code = bases[bits >> 16] + (y >= mid[base]), NaN -> 255;
    # over a sweep of every 4093rd 32-bit pattern (all signs, exponents, NaN and inf)
    from ampfunc.lowbits import q8_lookup

    maps, bases = q8_lookup()
    raw = torch.arange(0, 2 ** 32, 4093, dtype=torch.int64)
    y = torch.where(raw >= 2 ** 31, raw - 2 ** 32, raw).to(torch.int32).view(torch.float32)
    for row, signed in enumerate((True, False)):
        mids = maps[256 * (2 * row + 1): 256 * (2 * row + 2)]
        assert bool(torch.isnan(mids[255])) and bool((mids[:255] == map_midpoints(signed)).all())
        base = bases[row, :65536][raw >> 16].to(torch.int64)
        code = base + (y >= mids[base]).to(torch.int64)
        code = torch.where(torch.isnan(y), 255, code)
        ref = torch.searchsorted(map_midpoints(signed), y, right=True)
        assert bool((code == ref).all())
        assert bool((maps[512 * row: 512 * row + 256] == dynamic_map(signed)).all())
