"""Low-bit storage of fp32 numbers, in plain torch: split masters and 8-bit block-wise codes.

Two encodings that let a mixed-precision step keep less than fp32 per number, and the plain
torch reference of what the fused kernels do in registers.

**Split master** (:func:`split_bf16`, :func:`join_bf16`). An fp32 master ``x`` is stored as
the bf16 param ``hi`` plus an int16 ``lo`` (2 bytes), with ``bits(x) == (bits(hi) << 16) +
lo`` (``lo`` sign-extended; arithmetic on the raw 32-bit patterns). So ``lo`` is the signed
remainder of ``x`` against ``hi``: in ``[-2**15, 2**15)``, and ``hi`` is ``x`` rounded to the
nearest bf16, **ties away from zero** (the round-up test is the sign of ``lo``: raw low half
``>= 0x8000``), which is Transformer Engine's param-remainder split. Rounding ties to even,
as ``x.to(torch.bfloat16)`` does, cannot be exact in 16 bits: an even bf16 ``h`` is the
nearest-even rounding of 65,537 fp32 patterns (both ties belong to it), one more than 16 bits
can tell apart. So ``hi == x.to(torch.bfloat16)`` for every finite ``x`` except the exact
ties whose truncation is even, where ``hi`` is the neighbour away from zero (one bf16 ulp).
Non-finite values: ``±inf`` split exactly (``lo == 0``); a finite ``x`` that rounds past
bf16's largest number has ``hi == ±inf`` (as its cast has) and still joins back exactly; a
NaN splits to a bf16 NaN and ``lo == 0``, and joins to an fp32 NaN: its sign and payload are
not kept.

**q8 moments** (:func:`quantize_q8`, :func:`dequantize_q8`). A tensor of ``n`` elements
(``n`` a multiple of :data:`Q8_BLOCK` = 256) is stored as ``n`` uint8 codes and one fp32
``absmax`` per block of 256 consecutive elements (in memory order). A code indexes a 256-entry
*dynamic map* (bitsandbytes' ``create_dynamic_map``, the 8-bit Adam paper's): signed for
Adam's first moment, unsigned for the second; see :func:`dynamic_map`. Quantizing multiplies an
element by the reciprocal of its block's absmax, ``1 / absmax`` rounded once per block (as
bitsandbytes' 8-bit kernels do: one multiply per element where a division costs several times
more; a block of zeros uses 1, and a block whose reciprocal overflows, an absmax under about
2.9e-39, divides instead), and takes the *nearest* code:
the code whose interval between the fp32 midpoints of neighbouring map entries holds the
value, a value exactly on a midpoint taking the larger code (torchao's rule), NaN the last
code. Dequantizing is ``map[code] * absmax``. A block's largest magnitude comes back exactly
(the map holds 1.0; in the signed map, -absmax comes back as the map's most negative entry,
about -0.993 of it, as bitsandbytes). With the unsigned map a positive value never takes the code
of 0: one below half the smallest nonzero entry (about ``3.25e-7 * absmax``) takes that entry.
A second moment spans the square of the first moment's range, so in a block whose largest
gradient is 3,000 times another's, the small one's second moment would otherwise decode as 0
while its first moment does not, and its next update would be ``m / eps`` (the zero-point
problem of low-bit second moments, Li et al. 2023); the overestimate makes it smaller than
fp32's instead. An infinite value (a second moment that overflowed)
makes its block's absmax inf: it takes its sign's extreme code and comes back infinite, as it
would stay in fp32, and the block's finite values take the code of 0 and come back 0 (not
``0 * inf``, which is NaN): while the block holds the inf its other elements keep no history,
and :func:`ampfunc.monitor.moment_overflows` names the param. Tensors under
:data:`Q8_MIN_NUMEL` elements, or whose size is not a multiple of the block, are kept in fp32
by the optimizers.

Everything here is elementwise or per block, so the reference twins of the fused kernels are
these functions applied per leaf. Nothing reads a tensor back to the host.
"""

from __future__ import annotations

import torch

__all__ = [
    "Q8_BLOCK",
    "Q8_MIN_NUMEL",
    "dequantize_q8",
    "dynamic_map",
    "join_bf16",
    "map_midpoints",
    "q8_absmax_numel",
    "q8_eligible",
    "q8_lookup",
    "quantize_q8",
    "split_bf16",
]

Q8_BLOCK = 256
Q8_MIN_NUMEL = 4096

_NAN_F32 = 0x7FC00000


# ----------------------------------------------------------------------------------------------
# Split masters: fp32 = bf16 high half + int16 signed remainder
# ----------------------------------------------------------------------------------------------


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 tensor as ``(hi, lo)``: bf16 rounded to nearest (ties away from zero) and the
    int16 signed remainder, so that :func:`join_bf16` gives ``x`` back bit for bit.

    Args:
      x: a float32 tensor (any shape, contiguous or not).

    Returns:
      ``(hi, lo)``: new tensors of ``x``'s shape, bfloat16 and int16. See the module docstring
      for ties and non-finite values.

    Example:
      >>> x = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8])  # two ties
      >>> hi, lo = split_bf16(x)
      >>> hi.tolist(), x.to(torch.bfloat16).tolist(), lo.tolist()  # away from zero; to even
      ([1.0078125, 1.015625], [1.0, 1.015625], [-32768, -32768])
      >>> bool((join_bf16(hi, lo).view(torch.int32) == x.view(torch.int32)).all())
      True

    Cost: a few elementwise int32 passes (the fused kernels do it in registers); no host sync.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"split_bf16: x must be float32, got {x.dtype}")
    bits = x.view(torch.int32) if x.is_contiguous() else x.contiguous().view(torch.int32)
    bits = torch.where(torch.isnan(x), torch.full_like(bits, _NAN_F32), bits)
    lo = bits.to(torch.int16)  # the low half, as a signed number (two's complement wrap)
    # bits - lo is a multiple of 2**16 (NaN patterns excluded, in int32's range): an fp32 number
    # whose low half is zero, which the cast to bf16 keeps exactly. (Integer and fp32 views
    # only: torch.compile's inductor cannot reindex a bf16 <-> int16 view.)
    hi = (bits - lo.to(torch.int32)).view(torch.float32).to(torch.bfloat16)
    return hi, lo


def join_bf16(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor whose :func:`split_bf16` is ``(hi, lo)``: ``bits = (bits(hi) << 16) + lo``.

    Args:
      hi: a bfloat16 tensor.
      lo: an int16 tensor of ``hi``'s shape.

    Returns:
      A new float32 tensor of ``hi``'s shape.

    Example:
      >>> hi, lo = split_bf16(torch.tensor([3.14159]))
      >>> join_bf16(hi, lo).item()
      3.141590118408203

    Cost: a few elementwise int32 passes; no host sync.
    """
    if hi.dtype != torch.bfloat16 or lo.dtype != torch.int16:
        raise TypeError(f"join_bf16: expected bfloat16 hi and int16 lo, got {hi.dtype} and {lo.dtype}")
    if hi.shape != lo.shape:
        raise ValueError(f"join_bf16: hi has shape {tuple(hi.shape)} and lo {tuple(lo.shape)}")
    # bf16 -> fp32 is exact (the bits shifted up 16), then the signed remainder is added to the
    # pattern. A canonical pair (from split_bf16) never overflows int32 here.
    top = hi.float().view(torch.int32)
    out = (top + lo.to(torch.int32)).view(torch.float32)
    # Inside a compiled graph, a buffer of its own: inductor cannot apply a view (the kernels'
    # flattening) to a dtype view of a computed tensor.
    # (Not .clone(): inductor drops a clone as a no-op; a stack is a real copy.)
    return torch.stack([out])[0] if torch.compiler.is_compiling() else out


# ----------------------------------------------------------------------------------------------
# q8: block-wise 8-bit codes through a dynamic map
# ----------------------------------------------------------------------------------------------


def _map_values(signed: bool) -> tuple:
    # The dynamic map of bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7,
    # total_bits=8): for decade i = 0..6 (scale 10**(i-6)), the midpoints of 2**i + 1 (signed)
    # or 2**(i+1) + 1 (unsigned) points spaced evenly over [0.1, 1], computed in fp32, scaled
    # in double; both signs when signed; then 0 and 1; sorted; stored as fp32.
    values = [0.0, 1.0]
    for i in range(7):
        count = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        points = torch.linspace(0.1, 1.0, count, dtype=torch.float32)
        means = ((points[:-1] + points[1:]) / 2.0).tolist()
        scale = 10.0 ** (i - 6)
        values += [scale * m for m in means]
        if signed:
            values += [-scale * m for m in means]
    assert len(values) == 256
    return tuple(torch.tensor(sorted(values), dtype=torch.float32).tolist())


def dynamic_map(signed: bool, device=None) -> torch.Tensor:
    """The 256 fp32 values of the dynamic quantization map, increasing.

    Args:
      signed: True for the signed map (Adam's first moment, SGD's momentum: 127 negative
        values, 0, 128 positive values up to 1.0), False for the unsigned one (Adam's second
        moment: 0, then 255 positive values up to 1.0).
      device: where to make the tensor.

    Returns:
      A float32 tensor of 256 strictly increasing values, ``map[-1] == 1``.

    Example:
      >>> m = dynamic_map(signed=False)
      >>> m[0].item(), m[-1].item(), m.numel()
      (0.0, 1.0, 256)

    Cost: built once at import, then one small copy per call.
    """
    return torch.tensor(_MAPS[bool(signed)], dtype=torch.float32, device=device)


def _midpoint_values(signed: bool) -> tuple:
    m = torch.tensor(_MAPS[signed], dtype=torch.float32)
    return tuple(((m[:-1] + m[1:]) * 0.5).tolist())


# Built once at import, as Python numbers: a torch.compile trace reads them as constants.
_MAPS = {signed: _map_values(signed) for signed in (True, False)}
_MIDPOINTS = {signed: _midpoint_values(signed) for signed in (True, False)}


def map_midpoints(signed: bool, device=None) -> torch.Tensor:
    """The 255 fp32 decision points of :func:`quantize_q8`: ``(map[k] + map[k + 1]) * 0.5``
    computed in fp32. A value ``y`` takes code ``#{k : y >= mid[k]}`` (NaN: 255).

    Example:
      >>> map_midpoints(True).numel()
      255
    """
    return torch.tensor(_MIDPOINTS[bool(signed)], dtype=torch.float32, device=device)


_LOOKUP_PAD = 16


def _lookup_tables() -> tuple:
    maps, bases = [], []
    for signed in (True, False):
        qmap = dynamic_map(signed)
        # The 256th midpoint is NaN: every comparison with it is false (code 255 stays 255).
        mids = torch.cat([map_midpoints(signed), torch.tensor([float("nan")])])
        # Per top half of an fp32 pattern (sign, exponent, 7 mantissa bits): the code of the
        # bucket's lowest value. A bucket holds at most one midpoint (checked below), so a
        # value's code is its bucket's code plus one comparison with the next midpoint.
        top = torch.arange(1 << 16, dtype=torch.int64)
        ends = []
        for low in (0, 0xFFFF):
            raw = (top << 16) | low
            ends.append(torch.where(raw >= 2 ** 31, raw - 2 ** 32, raw).to(torch.int32).view(torch.float32))
        lowest, highest = torch.minimum(*ends), torch.maximum(*ends)
        first = torch.searchsorted(mids[:-1], lowest, right=True)
        last = torch.searchsorted(mids[:-1], highest, right=True)
        nan = torch.isnan(ends[0]) | torch.isnan(ends[1])
        assert bool(((last - first) <= 1)[~nan].all()), "a bucket holds two midpoints"
        base = torch.where(nan, torch.full_like(first, 255), first)
        base[0xFF80] = 0  # -inf (its bucket's other patterns are NaN, which the kernels test first)
        maps += [qmap, mids]
        # padded, so that a 4-byte vector gather at the last index stays inside the row
        bases.append(torch.cat([base.to(torch.uint8), torch.zeros(_LOOKUP_PAD, dtype=torch.uint8)]))
    return torch.cat(maps), torch.stack(bases)


# Built at import, not on first use: a torch.compile trace of a step reads them as constants
# instead of tracing their construction (or a functools.cache wrapper, which dynamo ignores).
_LOOKUP = _lookup_tables()


def q8_lookup(device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables the fused kernels quantize with: ``(maps, bases)``.

    ``maps`` is float32 ``(1024,)``: the signed map, its 255 midpoints and a NaN, the
    unsigned map, its midpoints and a NaN. ``bases`` is uint8 ``(2, 65552)`` (signed,
    unsigned): for each top 16 bits of an fp32 pattern, the code of the smallest value with
    them, then 16 bytes of padding. Every such bucket holds at most one midpoint, so :func:`quantize_q8`'s code of a
    non-NaN ``y`` is ``b + (y >= mid[b])`` with ``b = bases[bits(y) >> 16]``: one load and
    one comparison instead of a binary search (NaN: 255).

    Example:
      >>> maps, bases = q8_lookup()
      >>> maps.shape, bases.shape
      (torch.Size([1024]), torch.Size([2, 65552]))

    Cost: built once on the CPU at import (about 10 ms), then one copy per call to another
    device.
    """
    maps, bases = _LOOKUP
    return maps.to(device), bases.to(device)


def q8_eligible(numel: int) -> bool:
    """Whether a tensor of ``numel`` elements is stored in q8 (else it stays fp32): at least
    :data:`Q8_MIN_NUMEL` elements and a multiple of :data:`Q8_BLOCK`."""
    return numel >= Q8_MIN_NUMEL and numel % Q8_BLOCK == 0


def q8_absmax_numel(numel: int) -> int:
    """The number of fp32 absmax values (blocks) of a q8 tensor of ``numel`` elements."""
    return numel // Q8_BLOCK


def _blocks(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.numel() % Q8_BLOCK:
        raise ValueError(f"{what}: {x.numel()} elements is not a multiple of the block ({Q8_BLOCK})")
    return x.reshape(-1, Q8_BLOCK)


def quantize_q8(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as block-wise 8-bit codes: ``(codes, absmax)``.

    Args:
      x: a float32 tensor whose size is a multiple of 256 (blocks are 256 consecutive elements
        in memory order, so ``x`` is read as ``x.reshape(-1)``).
      signed: which :func:`dynamic_map` (True for values of both signs).

    Returns:
      ``(codes, absmax)``: uint8 codes of ``x``'s shape and float32 ``absmax`` of shape
      ``(numel // 256,)``, the largest magnitude of each block (NaN if the block holds one).
      With the unsigned map a negative value takes code 0 and a positive one at least code 1.

    Example:
      >>> x = torch.linspace(-1, 2, 256)
      >>> codes, absmax = quantize_q8(x, signed=True)
      >>> absmax.tolist(), codes.dtype, float((dequantize_q8(codes, absmax, True) - x).abs().max()) < 0.02
      ([2.0], torch.uint8, True)

    Cost: one absmax reduction, one reciprocal per block and one multiply per element, one
    binary search over 255 midpoints per element (``torch.searchsorted``) and an elementwise
    test for infinities; no host sync.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"quantize_q8: x must be float32, got {x.dtype}")
    blocks = _blocks(x, "quantize_q8")
    absmax = blocks.abs().amax(dim=1)
    # torch's amax propagates NaN: a block holding NaN gets absmax NaN, so it dequantizes to NaN.
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    # One reciprocal per block (a correctly rounded division), then a multiply per element: the
    # kernels' arithmetic. A reciprocal that overflows (absmax below 2**-128) would turn every
    # element into inf or NaN, so such a block divides.
    recip = torch.ones_like(divisor) / divisor
    scaled = torch.where(torch.isinf(recip)[:, None], blocks / divisor[:, None], blocks * recip[:, None])
    # An infinity (a second moment that overflowed) makes its block's absmax inf: it keeps its
    # sign's extreme code (inf * 0 would be NaN), and the block's finite values scale to 0.
    normed = torch.where(torch.isinf(blocks), blocks.sign(), scaled)
    mids = map_midpoints(signed, device=x.device)
    flat = normed.reshape(-1)
    codes = torch.searchsorted(mids, flat, right=True)
    if not signed:
        # No positive value is stored as 0: a second moment below half the map's smallest entry
        # keeps that entry (an overestimate) instead, so its update cannot become m / eps.
        codes = torch.where((codes == 0) & (flat > 0), torch.ones_like(codes), codes)
    return codes.to(torch.uint8).reshape(x.shape), absmax


def dequantize_q8(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """The float32 values of block-wise codes: ``map[code] * absmax`` of the code's block.

    Args:
      codes: uint8 codes (from :func:`quantize_q8`), size a multiple of 256.
      absmax: float32 of shape ``(codes.numel() // 256,)``.
      signed: which :func:`dynamic_map` the codes index.

    Returns:
      A new float32 tensor of ``codes``' shape.

    Example:
      >>> codes, absmax = quantize_q8(torch.ones(256), signed=False)
      >>> dequantize_q8(codes, absmax, signed=False).unique().tolist()
      [1.0]

    Cost: one gather from the 256-entry map and one multiply per element; no host sync.
    """
    if codes.dtype != torch.uint8 or absmax.dtype != torch.float32:
        raise TypeError(f"dequantize_q8: expected uint8 codes and float32 absmax, got {codes.dtype} and "
                        f"{absmax.dtype}")
    blocks = _blocks(codes, "dequantize_q8")
    if absmax.shape != (blocks.shape[0],):
        raise ValueError(f"dequantize_q8: {codes.numel()} codes need absmax of shape ({blocks.shape[0]},), got "
                         f"{tuple(absmax.shape)}")
    qmap = dynamic_map(signed, device=codes.device)
    mapped = qmap[blocks.to(torch.int64)]
    values = mapped * absmax[:, None]
    # In a block whose absmax is inf, the code of 0 stays 0 (0 * inf would be NaN and spread one
    # overflowed moment to its 255 neighbours); a NaN absmax still makes the whole block NaN.
    values = torch.where((mapped == 0) & torch.isinf(absmax)[:, None], torch.zeros_like(values), values)
    return values.reshape(codes.shape)
