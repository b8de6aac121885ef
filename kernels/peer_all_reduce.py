"""Torch reference for triton_peer_all_reduce.py (push) and triton_peer_read_all_reduce.py
(read): what every rank must get from an all-reduce of the ranks' partial sums followed by
the residual add and RMSNorm."""
from __future__ import annotations

import torch


def all_reduce_add_rms_norm_ref(partials: list[torch.Tensor], residual: torch.Tensor | None,
                                weight: torch.Tensor | None, eps: float):
    """partials: each rank's [T, H] in rank order. Sum in float32 in rank order, round to
    the input dtype (as an unfused all-reduce would), add the residual (rounded again, as
    the unfused add), normalise. Returns (out, new_residual), or (sum, None)."""
    dt = partials[0].dtype
    acc = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for p in partials:
        acc += p.float()
    s = acc.to(dt)
    if residual is None:
        return s, None
    h = (s.float() + residual.float()).to(dt)
    hf = h.float()
    inv = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (hf * inv * weight.float()).to(dt), h
