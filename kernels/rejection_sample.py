"""Speculative decoding's accept/reject step for drafts drawn from a distribution q.

For each request b with n_b draft tokens x_j (q_j the proposer's probabilities, p_j the
target's): accept x_j while u_j * q_j(x_j) < p_j(x_j); at the first rejected position draw
from max(0, p_j - q_j) (normalised), or from p_n when all n were accepted. Draws are Gumbel
maxima keyed on (key, token id), the sampler's hash (shared/engine/sampler.gumbel_noise),
so the result is a pure function of the inputs. One Triton program per request does the
whole thing (the torch reference loops on the host:
shared/engine/speculative/rejection.rejection_sample_reference)."""

from __future__ import annotations


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
    _check(target_logp, draft_probs, draft_tokens, num_draft, u, keys)
    from shared.engine.speculative.rejection import rejection_sample_reference as ref

    return ref(target_logp, draft_probs, draft_tokens, num_draft, u, keys)
