"""SwiGLU activation: silu(x[:, :I]) * x[:, I:] for x [T, 2I]."""

import torch


def _check(x):
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even (gate and up halves), got {x.shape[-1]}")


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    acc = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64 inputs
    gate, up = x.to(acc).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul(x: torch.Tensor, out=None) -> torch.Tensor:
    """Triton; math in float32. out: optional contiguous [..., I] result."""
    _check(x)
    from kernels.triton_silu_and_mul import launch_silu_and_mul

    return launch_silu_and_mul(x, out)
