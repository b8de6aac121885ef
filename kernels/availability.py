"""Cheap probe: can the Triton kernels in this package run in this process?"""

import importlib.util
import os


def triton_interpret_enabled() -> bool:
    """True when Triton is told to run kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """True when triton imports and there is something to run it on: a CUDA
    device, or the interpreter (TRITON_INTERPRET=1). triton is imported only
    after the cheap checks pass, so a CPU-only process without the interpreter
    never pays for the import."""
    if importlib.util.find_spec("triton") is None:
        return False
    if not triton_interpret_enabled():
        import torch

        if not torch.cuda.is_available():
            return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent
        return False
    return True
