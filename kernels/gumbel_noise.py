"""The keyed Gumbel noise every draw adds to log-probabilities: a pure function of (key,
token id), so a draw is the same on whichever worker, batch or kernel makes it. The sampler
(shared/engine/sampler.py) and the rejection sampler's torch reference use this; the Triton
rejection kernel evaluates the same hash (kernels/triton_rejection_sample._gumbel)."""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n] int64 keys -> [n, vocab] float32 Gumbel noise, a pure function of (key, index).
    Multipliers stay below 2**31 so int64 products never overflow."""
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = (keys[:, None] ^ ((idx[None, :] * 0x61C88647) & _M32))
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 16)
    u = (x.to(torch.float64) + 0.5) / 4294967296.0
    return (-torch.log(-torch.log(u))).to(torch.float32)
