"""Triton pieces of programmatic dependent launch (see kernels/pdl.py). Imported lazily."""

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton < 3.4: pdl_supported() is False, so PDL=True is never traced
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Let the next kernel be scheduled, then wait until the previous one has finished and
    its writes are visible. Nothing global may be read (but constant weights) or written
    before this. Without PDL: nothing."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs (one address per line); nothing comes back."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
