"""What every attention backend needs to know about one forward step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.extend_attention import ExtendWork


@dataclass(frozen=True)
class DecodeLead:
    """A mixed step's leading one-token rows (the decode rows the scheduler puts first) and the
    sequences after them: their offsets from 0 and their longest extend (None, 0: none after)."""

    rows: int
    rest_qo_indptr: torch.Tensor | None
    rest_max_extend: int


@dataclass
class AttentionMetadata:
    is_decode: bool  # every sequence adds one token
    page_size: int
    # per sequence [B]
    seq_lens: torch.Tensor  # int32: KV length after this step (prefix + new)
    extend_lens: torch.Tensor  # int32: new tokens this step
    qo_indptr: torch.Tensor  # int32 [B+1]: offsets of each sequence's new tokens
    page_table: torch.Tensor  # int32 [B, max_pages], padded with the padding page
    # per new token [T]
    slot_mapping: torch.Tensor  # int64: page * page_size + offset where its K/V goes
    # host copies for backends that loop on the CPU
    seq_lens_host: list[int]
    extend_lens_host: list[int]
    num_pages_host: list[int]
    # every sequence extends by this many tokens (a speculative verify step, 2..16); 0: not so
    uniform_q: int = 0
    # the extend kernel's (sequence, query block) list, in place of a grid sized from the host
    # lists (a captured graph's step: kernels.extend_attention.ExtendWork)
    work: ExtendWork | None = None
    # int32 [R]: a captured mixed step's leading one-token sequences' KV lengths, 0 past them
    # (kernels.extend_attention.leading_decode_rows; the work list skips them); None: from the host lists
    lead_seq_lens: torch.Tensor | None = None
    # an eager mixed step's split, once a step (TritonAttentionBackend.prepare); None: not split
    decode_lead: DecodeLead | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)
