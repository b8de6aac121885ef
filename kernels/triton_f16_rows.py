"""Rows of a 16-bit tile moved into fp16 for the tensor cores, exactly (imported lazily: needs
triton). Where the other operand is FP8, widening it to fp16 takes one hardware conversion per two
values, against two or three to bf16 or fp32 on a unit that runs at a quarter of the FP32 rate;
the 16-bit side then has to be fp16 too. bf16's range does not fit fp16's, so
each row is scaled by a power of two that puts its largest |x| in [2^13, 2^14): exact for every
element above 2^-30 of that largest one (fp16 holds bf16's 8 significant bits there), far from
fp16's 65504 limit, and undone exactly by the returned factor (rows whose largest |x| is below
2^-113 stay below 2^13: the factor is clamped to a normal float, harmless)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rows_to_f16(x):
    """(x [R, C] * 2^-e as fp16, 2^e [R] in fp32), e per row (zero rows: any normal factor).
    An fp16 x is already there: as it is, with factors of 1 (scaling it could only lose bits)."""
    if x.dtype == tl.float16:
        x16 = x
        down = tl.full((x.shape[0],), 1.0, tl.float32)
    else:
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), axis=1)
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 140  # exponent of amax, minus 13
        e = tl.minimum(tl.maximum(e, -126), 126)
        up = ((127 - e) << 23).to(tl.float32, bitcast=True)
        down = ((127 + e) << 23).to(tl.float32, bitcast=True)
        x16 = (xf * up[:, None]).to(tl.float16)
    return x16, down
