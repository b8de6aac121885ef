"""Turns a scheduled Batch into tensors, runs the model, and returns logits for the rows
that sample. Owns the model, the KV pool and the attention backend.

A step is first planned on the host (step_plan.py: one int32 array), then turned into
device tensors with one copy. With tensor parallelism, rank 0 sends each plan to the
other ranks (`plan_sink`) before running it, and every rank runs the same forward."""
from __future__ import annotations

import time

from dataclasses import dataclass

import torch

from .attention.base import AttentionBackend
from .attention.metadata import AttentionMetadata
from .batch import Batch
from .kv_pool import KVPool
from .step_plan import StepPlan, plan_batch


@dataclass
class ForwardBatch:
    """What the model's layers see: the backend and this step's metadata."""
    attn_backend: AttentionBackend
    attn: AttentionMetadata


class ModelRunner:
    def __init__(self, model, pool: KVPool, backend: AttentionBackend, device: torch.device):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device
        self.page_size = pool.layout.page_size
        self.graphs = None  # CudaGraphRunner, set by the engine on GPU
        self.plan_sink = None  # TP rank 0: callable(StepPlan) that sends the plan to the other ranks
        self.future_tokens: torch.Tensor | None = None  # overlap scheduling: placeholder -> token
        # CUDA graphs of steps where every sequence extends by the same few tokens
        # (speculative verify steps; speculative/uniform_graph.py), set by the speculator
        self.extend_graphs = None
        # CUDA graphs of small prefill steps (prefill_graph.py), set by the engine on GPU
        self.prefill_graphs = None
        # LoRA (shared/engine/lora/layer.py LoraStep): each step's rows' adapter slots, set by an
        # engine that serves adapters; the step plan then carries them
        self.lora = None
        self.last_forward_at = 0.0  # time.monotonic() of the last step's launch (the host tier pins while idle)

    def build(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        plan = plan_batch(batch, self.page_size, self.lora is not None)
        input_ids, positions, meta, rows = self.tensors(plan)
        return input_ids, positions, meta, rows.tolist()

    def tensors(self, plan: StepPlan):
        """(input_ids, positions, metadata, sample_rows) as device tensors (int32)."""
        host = torch.from_numpy(plan.data)
        if self.device.type == "cuda":
            dev_data = host.pin_memory().to(self.device, non_blocking=True)
        else:
            dev_data = host
        sec = plan.sections()

        def view(name):
            a, b = sec[name]
            return dev_data[a:b]

        b, w = plan.batch_size, plan.width
        seq_lens_host = plan.host("seq_lens").tolist()
        ext_host = plan.host("extend_lens").tolist()
        ps = self.page_size
        meta = AttentionMetadata(
            is_decode=plan.is_decode, page_size=ps,
            seq_lens=view("seq_lens"), extend_lens=view("extend_lens"), qo_indptr=view("qo_indptr"),
            page_table=view("page_table").view(b, w), slot_mapping=view("slots"),
            seq_lens_host=seq_lens_host, extend_lens_host=ext_host,
            num_pages_host=[-(-s // ps) for s in seq_lens_host], uniform_q=uniform_extend(ext_host))
        input_ids = view("ids")
        if self.lora is not None:
            self.lora.set_rows(view("lora"), bool((plan.host("lora") >= 0).any()))
        if self.future_tokens is not None and plan.has_placeholders:
            input_ids = resolve_placeholders(input_ids, self.future_tokens)
        return input_ids, view("positions"), meta, view("sample_rows")

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits [n_sampling_rows, vocab] (None when no sequence samples this step)."""
        plan = plan_batch(batch, self.page_size, self.lora is not None)  # (KV loaded back from the host tier has landed: scheduler)
        if self.plan_sink is not None:
            self.plan_sink(plan)
        return self.forward_plan(plan)

    @torch.inference_mode()
    def forward_plan(self, plan: StepPlan) -> torch.Tensor | None:
        self.last_forward_at = time.monotonic()
        input_ids, positions, meta, rows = self.tensors(plan)
        if self.graphs is not None and self.graphs.can_run(None, meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        elif self.extend_graphs is not None and self.extend_graphs.can_run(meta):
            hidden = self.extend_graphs.run(input_ids, positions, meta)
        elif self.prefill_graphs is not None and self.prefill_graphs.can_run(meta):
            hidden = self.prefill_graphs.run(input_ids, positions, meta)
        else:
            self.backend.prepare(meta)
            hidden = self.model(input_ids, positions, ForwardBatch(self.backend, meta))
        if plan.num_sample == 0:
            return None
        if plan.num_sample == plan.num_tokens:  # decode: every row samples
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden.index_select(0, rows))


MAX_UNIFORM_Q = 16


def uniform_extend(extend_lens: list[int]) -> int:
    """The common extend length when every sequence extends by the same 2..16 tokens, else 0."""
    if not extend_lens:
        return 0
    q = extend_lens[0]
    return q if 1 < q <= MAX_UNIFORM_Q and all(x == q for x in extend_lens) else 0


def resolve_placeholders(ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """Replace placeholder ids (-(slot+1)) by the tokens sampled into future[slot]."""
    slot = (-ids - 1).clamp_min(0)
    return torch.where(ids < 0, future[slot].to(ids.dtype), ids)
