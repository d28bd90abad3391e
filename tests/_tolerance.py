"""How close a compiled (inductor) result must be to its eager twin.

Inductor generates its own C++ for the glue between our opaque ops (the clip coefficient, the
reciprocal of the scale, the global norm's sum) and compiles it with flags chosen for the CPU it
runs on (AVX2 or AVX-512 vector widths, FMA contraction, another summation order). On one CPU
that glue happens to round like eager; on another (an AVX-512 AMD EPYC) it is one ulp off from
the first step, and our kernels then carry that ulp into the master weights and moments. So a
compiled-vs-eager comparison is bitwise only where no compiler-generated arithmetic is involved
(integer and boolean state, the skip decision, the loss scale, which only ever moves by a power
of two); float state gets a tolerance of a few ulps, and a low-precision copy cast from a master
may land on the neighbouring value of its own dtype.
"""

import torch

# fp32/fp64: ~8 ulps relative at 1.0; the absolute part covers moments that cancel towards 0,
# where one ulp of the gradient (not of the result) is the unit of error.
_RTOL_F32, _ATOL_F32 = 1e-6, 1e-6


def assert_compiled_close(compiled: torch.Tensor, eager: torch.Tensor, what: str = "") -> None:
    """Asserts ``compiled`` equals ``eager`` up to what a compiler's reassociation can change."""
    assert compiled.dtype == eager.dtype and compiled.shape == eager.shape, what
    if not torch.is_floating_point(eager):
        assert torch.equal(compiled, eager), what
        return
    if eager.dtype in (torch.float16, torch.bfloat16):
        # A cast of a master that moved by an ulp can round to the neighbouring half value.
        rtol, atol = torch.finfo(eager.dtype).eps, 1e-6
    else:
        rtol, atol = _RTOL_F32, _ATOL_F32
    torch.testing.assert_close(compiled, eager, rtol=rtol, atol=atol, equal_nan=True, msg=what or None)
