"""Speculative decoding's accept/reject step for drafts drawn from a distribution q.

For each request b with n_b draft tokens x_j (q_j the proposer's probabilities, p_j the
target's): accept x_j while u_j * q_j(x_j) < p_j(x_j); at the first rejected position draw
from max(0, p_j - q_j) (normalised), or from p_n when all n were accepted. Draws are Gumbel
maxima keyed on (key, token id), the sampler's hash (kernels/gumbel_noise.py), so the
result is a pure function of the inputs. One Triton program per request does the whole
thing; the torch reference below loops on the host. How the engine keys the uniforms and
the draws: shared/engine/speculative/rejection.py."""

from __future__ import annotations

import torch

from kernels.gumbel_noise import gumbel_noise


def _check(target_logp, draft_probs, draft_tokens, num_draft, u, keys):
    B, K1, V = target_logp.shape
    if draft_probs.shape != (B, K1 - 1, V) or draft_tokens.shape != (B, K1 - 1):
        raise ValueError("draft_probs must be [B, K, V] and draft_tokens [B, K] for target_logp [B, K+1, V]")
    if num_draft.shape != (B,) or u.shape != (B, K1 - 1) or keys.shape != (B, K1):
        raise ValueError("num_draft [B], u [B, K], keys [B, K+1]")


def rejection_sample(target_logp, draft_probs, draft_tokens, num_draft, u, keys):
    """Triton; (accepted [B] int64, final [B] int64). Arguments as the reference's."""
    _check(target_logp, draft_probs, draft_tokens, num_draft, u, keys)
    from kernels.triton_rejection_sample import launch_rejection_sample

    return launch_rejection_sample(target_logp, draft_probs, draft_tokens, num_draft, u, keys)


def rejection_sample_reference(target_logp, draft_probs, draft_tokens, num_draft, u, keys):
    """One request per row b, K = draft_probs.shape[1]:
    target_logp [B, K+1, V] the target's sampling log-probabilities at each position,
    draft_probs [B, K, V], draft_tokens [B, K] int64, num_draft [B] (real drafts; <= K),
    u [B, K] float64 acceptance uniforms, keys [B, K+1] int64 Gumbel keys of the positions.
    Returns (accepted [B] int64, final [B] int64): how many drafts were accepted and the
    token drawn after them (residual or bonus)."""
    _check(target_logp, draft_probs, draft_tokens, num_draft, u, keys)
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
