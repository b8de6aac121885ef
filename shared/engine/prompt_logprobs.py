"""Prompt logprobs (OpenAI's `echo` with `logprobs`): the logprob of every prompt token
under the model, and its top alternatives, computed once where the prompt is computed
(prefill), from the rows step_plan keeps for it (ScheduledReq.all_rows).

Row j of a chunk (position start + j) predicts token start + j + 1; the first prompt
token has no logprob (None). Requests asking for them skip the prefix cache, so every
prompt position is computed (kv_manager.match_prefix)."""
from __future__ import annotations

import torch


def record_prompt_logprobs(batch, logits: torch.Tensor) -> torch.Tensor:
    """Fill req.prompt_lps for the items that kept all rows; return the sampling rows'
    logits in batch order (what the sampler expects)."""
    keep, row = [], 0
    for it in batch.items:
        if it.all_rows:
            req = it.req
            last = min(it.end, req.num_prompt - 1)  # positions start..last-1 predict prompt tokens
            if last > it.start:
                n = last - it.start
                lp = logits[row:row + n].float().log_softmax(dim=-1)
                targets = torch.tensor(req.token_ids[it.start + 1:last + 1], device=lp.device)
                chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
                k = req.params.prompt_logprobs
                tops = ([list(zip(i.tolist(), v.tolist())) for v, i in zip(*lp.topk(k, dim=-1))]
                        if k else [[] for _ in range(n)])
                for j in range(n):
                    req.prompt_lps[it.start + 1 + j] = (chosen[j], tops[j])
            row += it.length
            if it.samples:
                keep.append(row - 1)
        elif it.samples:
            keep.append(row)
            row += 1
    if row == logits.shape[0] and len(keep) == row:
        return logits
    return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
