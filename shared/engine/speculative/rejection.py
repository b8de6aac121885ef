"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) with keyed randomness.

For draft token x_j drawn from the proposer's q_j, the target's p_j accepts it with
probability min(1, p_j(x_j) / q_j(x_j)); the first rejected position draws from the
residual max(0, p_j - q_j) (normalised); when all K are accepted a bonus token comes from
p_K. The result is distributed exactly as p, whatever q is.

Every draw is a pure function of the request's seed and the position it decides, as the
plain sampler's are (sampler.draw_key): the acceptance test uses a uniform keyed on
(seed, position, ACCEPT_SALT), the residual and the bonus use the plain sampler's Gumbel
key (seed, position). A point-mass draft (n-gram, greedy draft model) needs no test at
all: "accept while the target's own Gumbel draw equals the draft" accepts x with
probability p(x) and otherwise yields a draw from p without x, which is the same rule; it
also yields exactly the tokens the request gets without speculation (verify.py).

The accept/reject step itself is kernels/rejection_sample.py (the Triton kernel and, beside
it, its plain-torch reference `rejection_sample_reference`); this module keys its inputs."""
from __future__ import annotations

import torch

from ..sampler import draw_key

ACCEPT_SALT = 0x5EC0A11CE5
DRAFT_SALT = 0xD7AF7D7AF7


def accept_key(seed: int, position: int) -> int:
    return draw_key(seed ^ ACCEPT_SALT, position)


def draft_key(seed: int, position: int) -> int:
    """The key a sampling proposer draws draft token `position` with (not the target's)."""
    return draw_key(seed ^ DRAFT_SALT, position)


def uniform(keys: torch.Tensor) -> torch.Tensor:
    """[n] int64 keys -> [n] float64 uniforms in (0, 1), a pure function of the key."""
    x = keys & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return (x.to(torch.float64) + 0.5) / 4294967296.0
