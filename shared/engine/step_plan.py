"""One forward step's inputs as a single int32 array.

The scheduler's Batch holds Python objects; the model needs a handful of small integer
tensors. Packing them into one array gives one host-to-device copy per step (pinned,
non-blocking, so the CPU can run ahead of the GPU), and one message for tensor-parallel
rank 0 to send to the other ranks, which rebuild the same tensors from it.

Layout: header [is_decode, T, B, W, S, L], then ids[T] positions[T] slots[T] seq_lens[B]
extend_lens[B] qo_indptr[B+1] page_table[B*W] sample_rows[S] lora[L]. Token ids < 0 are
placeholders for tokens still being sampled on the device (overlap scheduling). `lora` is each
row's LoRA slot (-1: the base model; shared/engine/lora/), L = T on an engine that serves
adapters, else 0."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import Batch
from .kv_pool import PADDING_PAGE

HEADER = 6


@dataclass
class StepPlan:
    data: np.ndarray  # int32, header + payload

    @property
    def is_decode(self) -> bool:
        return bool(self.data[0])

    @property
    def num_tokens(self) -> int:
        return int(self.data[1])

    @property
    def batch_size(self) -> int:
        return int(self.data[2])

    @property
    def width(self) -> int:
        return int(self.data[3])

    @property
    def num_sample(self) -> int:
        return int(self.data[4])

    @property
    def num_lora_rows(self) -> int:
        return int(self.data[5])

    def sections(self) -> dict[str, tuple[int, int]]:
        """name -> (start, end) offsets into data."""
        t, b, w, s = self.num_tokens, self.batch_size, self.width, self.num_sample
        out, pos = {}, HEADER
        for name, n in (("ids", t), ("positions", t), ("slots", t), ("seq_lens", b), ("extend_lens", b),
                        ("qo_indptr", b + 1), ("page_table", b * w), ("sample_rows", s),
                        ("lora", self.num_lora_rows)):
            out[name] = (pos, pos + n)
            pos += n
        return out

    def host(self, name: str) -> np.ndarray:
        a, b = self.sections()[name]
        return self.data[a:b]

    @property
    def has_placeholders(self) -> bool:
        return self.num_tokens > 0 and int(self.host("ids").min()) < 0


def plan_batch(batch: Batch, page_size: int, lora: bool = False) -> StepPlan:
    """lora: the engine serves adapters; each row carries its request's slot (Req.lora_slot)."""
    ps = page_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    seq_lens, ext_lens, npages, sample_rows = [], [], [], []
    row = 0
    for it in batch.items:
        r = it.req
        pages = r.page_ids
        if it.length == 1:  # decode: plain Python beats numpy for one token
            p = it.start
            ids.append(r.token_ids[p])
            pos.append(p)
            slots.append(pages[p // ps] * ps + p % ps)
        else:
            ids.extend(r.token_ids[it.start:it.end] if not it.draft else [r.token_ids[it.start], *it.draft])
            rng = np.arange(it.start, it.end, dtype=np.int64)
            pos.extend(rng.tolist())
            slots.extend((np.asarray(pages, dtype=np.int64)[rng // ps] * ps + rng % ps).tolist())
        seq_lens.append(it.end)
        ext_lens.append(it.length)
        npages.append(-(-it.end // ps))
        row += it.length
        if it.all_rows or it.draft:  # prompt logprobs or a verify: every row of the chunk
            sample_rows.extend(range(row - it.length, row))
        elif it.samples:
            sample_rows.append(row - 1)
    b = len(batch.items)
    w = max(max(npages, default=1), 1)
    table = np.full((b, w), PADDING_PAGE, dtype=np.int32)
    for i, it in enumerate(batch.items):
        n = npages[i]
        table[i, :n] = it.req.page_ids[:n]
    qo = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(ext_lens, out=qo[1:])
    lora_rows = np.repeat(np.asarray([it.req.lora_slot for it in batch.items], dtype=np.int32),
                          ext_lens) if lora else np.zeros(0, dtype=np.int32)
    header = [int(batch.is_decode), len(ids), b, w, len(sample_rows), len(lora_rows)]
    data = np.concatenate([np.asarray(header + ids + pos + slots + seq_lens + ext_lens, dtype=np.int32),
                           qo.astype(np.int32), table.reshape(-1), np.asarray(sample_rows, dtype=np.int32),
                           lora_rows])
    return StepPlan(data)
