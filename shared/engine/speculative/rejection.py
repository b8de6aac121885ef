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

`rejection_sample_reference` is the plain-torch reference of kernels/rejection_sample."""
from __future__ import annotations

import torch

from ..sampler import draw_key, gumbel_noise

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


def rejection_sample_reference(target_logp: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                               num_draft: torch.Tensor, u: torch.Tensor, keys: torch.Tensor):
    """One request per row b, K = draft_probs.shape[1]:
    target_logp [B, K+1, V] the target's sampling log-probabilities at each position,
    draft_probs [B, K, V], draft_tokens [B, K] int64, num_draft [B] (real drafts; <= K),
    u [B, K] float64 acceptance uniforms, keys [B, K+1] int64 Gumbel keys of the positions.
    Returns (accepted [B] int64, final [B] int64): how many drafts were accepted and the
    token drawn after them (residual or bonus)."""
    B, K1, V = target_logp.shape
    accepted = torch.zeros(B, dtype=torch.int64, device=target_logp.device)
    final = torch.zeros(B, dtype=torch.int64, device=target_logp.device)
    for b in range(B):
        n = int(num_draft[b])
        a = 0
        while a < n:
            x = int(draft_tokens[b, a])
            p = float(target_logp[b, a, x].exp())
            q = float(draft_probs[b, a, x])
            if float(u[b, a]) * q < p:
                a += 1
                continue
            break
        accepted[b] = a
        g = gumbel_noise(keys[b, a:a + 1], V)[0]
        if a < n:  # rejected at a: draw from the residual
            resid = (target_logp[b, a].exp() - draft_probs[b, a]).clamp_min(0)
            if float(resid.sum()) <= 0:  # p <= q everywhere only by rounding: draw from p
                resid = target_logp[b, a].exp()
            final[b] = int((resid.log() + g).argmax())
        else:
            final[b] = int((target_logp[b, a] + g).argmax())
    return accepted, final

