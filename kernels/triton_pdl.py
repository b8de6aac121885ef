"""Triton pieces of programmatic dependent launch (see kernels/pdl.py). Imported lazily."""

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton < 3.4: pdl_supported() is False, so PDL=True is never traced
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_enter(PDL: tl.constexpr, WAIT_FIRST: tl.constexpr = False):
    """Let the next kernel be scheduled, then wait until the previous one has finished and
    its writes are visible (WAIT_FIRST: the wait first, kernels/pdl.py pdl_wait_first). Nothing
    global may be read (but constant weights) or written before this. Without PDL: nothing."""
    if PDL:
        if WAIT_FIRST:
            gdc_wait()
            gdc_launch_dependents()
        else:
            gdc_launch_dependents()
            gdc_wait()


@triton.jit
def pdl_enter_late(PDL: tl.constexpr, LATE: tl.constexpr):
    """pdl_enter, or with LATE only its wait: the kernel then lets the next one be scheduled
    itself, after its main loop (pdl_release)."""
    if PDL:
        if not LATE:
            gdc_launch_dependents()
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr, LATE: tl.constexpr):
    """A LATE kernel's signal that the next kernel may be scheduled (its main loop is done; the
    next kernel still waits for this one to finish before it reads anything)."""
    if PDL:
        if LATE:
            gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ptrs (one address per line); nothing comes back."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
