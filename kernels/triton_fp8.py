"""Triton device functions the FP8 kernels share (imported lazily: needs triton).

fp8_grid rounds float32 values onto the float8_e4m3fn grid (saturated at +-448, round to
nearest even, subnormals included), still float32, so the conversion that follows is exact.
On the GPU it is the hardware conversion (cvt.rn.satfinite.e4m3x2.f32) and back. Triton's CPU
interpreter casts float to fp8 by rounding half up and loses the carry into the exponent
(-31.8 becomes -16), so there the same rounding is done in float32 arithmetic
(fp8_grid_arith), which the CPU tests hold bit for bit against torch. Which one a process
uses is fixed at import, as Triton's interpreter itself is.
"""

import triton
import triton.language as tl

from kernels.availability import triton_interpret_enabled

FP8_MAX = tl.constexpr(448.0)  # a plain global cannot be read inside @triton.jit on the GPU


@triton.jit
def fp8_grid_hardware(x):
    """x (float32) clamped to +-448 and rounded to the nearest float8_e4m3fn value by the GPU's
    conversion, back in float32."""
    a = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return a.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def fp8_grid_arith(x):
    """x (float32) clamped to +-448 and rounded to the nearest float8_e4m3fn value (ties to
    even), still float32: `fp8_grid(x).to(fp8)` is exact."""
    a = tl.minimum(tl.abs(x), FP8_MAX)
    bits = a.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # below 2^-6 the fp8 grid is the subnormal step 2^-9
    # adding 1.5 * 2^(exp + 20) puts |x|'s fp8 step (2^(exp - 3)) at float32's last bit:
    # the add rounds |x| to that step (nearest, ties to even), the subtract is exact
    magic = (((exp + 20 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign applied last: -0.0 stays -0.0, as torch rounds it


fp8_grid = fp8_grid_arith if triton_interpret_enabled() else fp8_grid_hardware


@triton.jit
def fp8_quantize(x, inv_scale):
    """float32 values times inv_scale, on the fp8 grid (float32)."""
    return fp8_grid(x * inv_scale)
