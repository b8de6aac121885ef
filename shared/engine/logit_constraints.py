"""Per-request edits of the logits before a token is chosen: OpenAI's logit_bias and the
grammar's token bitmask.

`prepare` runs on the host only (no device work, so in the plain loop it overlaps the
forward the GPU is still running; the overlap loop calls it while the next forward runs);
`apply` then edits the logits on their device without waiting for anything: host values
go over in pinned, non-blocking copies."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .grammar import apply_bitmask


@dataclass
class Constraints:
    bitmask: torch.Tensor  # [n, words] int32 on the host (pinned on GPU machines)
    rows: list[int]  # rows whose bitmask is live (a matcher that is not terminated)


def prepare(rows, grammars, pin: bool) -> Constraints | None:
    """Fill the bitmask rows of constrained requests; None when no row is constrained."""
    states = [getattr(r, "grammar", None) for r in rows]
    if grammars is None or all(s is None for s in states):
        return None
    bitmask = grammars.alloc_bitmask(len(rows), pin)
    filled = grammars.fill(states, bitmask)
    return Constraints(bitmask, filled) if filled else None


def needs_edit(rows, constraints: Constraints | None) -> bool:
    return constraints is not None or any(getattr(r, "logit_bias", None) for r in rows)


def _host_to(values, dtype, device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def apply(logits: torch.Tensor, rows, constraints: Constraints | None) -> None:
    """In place: add each row's logit bias, then mask tokens outside its grammar to -inf
    (after the bias, so a bias can never let a forbidden token through)."""
    idx_r, idx_t, vals = [], [], []
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        for token, bias in (getattr(r, "logit_bias", None) or {}).items():
            if token < vocab:
                idx_r.append(i)
                idx_t.append(token)
                vals.append(bias)
    if idx_r:
        dev = logits.device
        logits.index_put_((_host_to(idx_r, torch.int64, dev), _host_to(idx_t, torch.int64, dev)),
                          _host_to(vals, torch.float32, dev).to(logits.dtype), accumulate=True)
    if constraints is not None:
        apply_bitmask(logits, constraints.bitmask, constraints.rows)
