"""Accuracy checks the kernel tests share: poisoned outputs and relative error."""

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf, so it never passes."""
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / max(denom, 1e-30)


def fill_nan_(t: torch.Tensor) -> torch.Tensor:
    """Poison a floating tensor in place so unwritten elements show up as NaN."""
    return t.fill_(float("nan"))
