"""The parts Engine.__init__ builds from its EnginePlan (plan.py), one function a part: the
small-batch and FP8 linear routes, the custom all-reduce, PDL on the decode kernels, and the
decode and prefill CUDA graphs. The plan decided whether and how; these only build."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from .plan import DecodeGraphs, EnginePlan, PdlPlan

log = logging.getLogger("duet.engine")


def route_linears(model, plan: EnginePlan, device: torch.device):
    """Send decode-size linears to the split-K small-batch kernel where plan.linears says, and FP8
    linears to the W8A8 decode GEMM up to plan.fp8_decode_gemm rows (else the same kernel, W8A16).
    Returns the workspace they share (kernels/small_batch_linear.py), or None."""
    from kernels.small_batch_linear import SmallBatchWorkspace
    workspace = None
    if plan.linears.value is not None:
        from .models.layers import enable_small_batch_linears
        workspace = SmallBatchWorkspace.create(device)
        enable_small_batch_linears(model, workspace, mode=plan.linears.value)
    if plan.weights.value == "fp8":  # FP8 decode sizes: the small-batch kernel or the decode GEMM, both split-K
        workspace = workspace or SmallBatchWorkspace.create(device)
        on = plan.fp8_decode_gemm.value > 0
        for m in model.modules():
            if getattr(m, "fp8", None) and hasattr(m, "small_batch"):
                m.small_batch = replace(m.small_batch or workspace, fp8_decode_gemm=on)
    return workspace


def attach_custom_all_reduce(tp, device: torch.device, mode: str) -> str:
    """Set the custom all-reduce up on every rank or on none (all ranks call this together).
    Returns "" when it is in place, else why not."""
    from .parallel.custom_all_reduce import CustomAllReduce
    if not tp.all_ranks_agree(CustomAllReduce.fresh_process(), device):
        return "a rank set one up before in its process"
    car = CustomAllReduce.try_create(tp, device, mode=mode)
    if not tp.all_ranks_agree(car is not None, device):
        return "a rank could not map its peers' memory (its log says why)"
    tp.custom_all_reduce = car
    return ""


def enable_decode_pdl(model, backend, pdl_plan: PdlPlan | None):
    """Launch the decode kernels with programmatic dependent launch (kernels/pdl.py): the model's
    and the attention backend's. Returns the Pdl, or None."""
    if pdl_plan is None:
        return None
    from .models.layers import enable_pdl
    enable_pdl(model, pdl_plan.pdl, dict(pdl_plan.prefetch_at))
    if hasattr(backend, "pdl"):
        backend.pdl = pdl_plan.pdl
    return pdl_plan.pdl


def decode_graphs(model, backend, pool, device: torch.device, graphs: DecodeGraphs, max_pages: int):
    """The decode steps' graph runner (cuda_graph.py); with capture off it pads to the same
    sizes and launches eagerly: identical numbers either way."""
    from .cuda_graph import CudaGraphRunner
    return CudaGraphRunner(model, backend, pool, device, max_bs=graphs.sizes[-1], max_pages=max_pages,
                           sizes=list(graphs.sizes), capture=graphs.capture)


def prefill_graphs(model, backend, device: torch.device, max_tokens: int, max_pages: int, decode_rows: int):
    """(PrefillGraphs, "") for small prefill steps and for steps that carry a prompt beside up
    to `decode_rows` decode rows (prefill_graph.py), or (None, why) where the model's prefill
    path cannot be captured."""
    from .prefill_graph import PrefillGraphs, graph_seqs
    try:
        return PrefillGraphs(model, backend, device, max_tokens=max_tokens, max_pages=max_pages,
                             max_seqs=graph_seqs(max_tokens, decode_rows)), ""
    except (RuntimeError, ValueError) as exc:
        torch.cuda.synchronize(device)
        return None, f"capture failed: {exc}"


def lora_manager(model, mc, config, plan: EnginePlan, dtype: torch.dtype, device: torch.device):
    """The LoRA slots hooked into the model and the --lora adapters loaded (shared/engine/lora/),
    or None when the plan serves no adapters."""
    lora = plan.lora.value
    if lora is None:
        return None
    from .lora.manager import LoraManager
    # rows a step may hold: the token budget, verify steps' drafts, the graphs' padded sizes
    rows = plan.step_tokens.value + config.max_running_requests * (config.speculative_tokens + 1)
    rows = max(rows, config.cuda_graph_max_bs, config.prefill_graph_max_tokens)
    manager = LoraManager(model, mc, config.lora, dtype, device, triton=lora.triton, max_rows=rows)
    log.info("LoRA: %d slots of rank %d (%.1f MiB on %s), adapters: %s", lora.slots, lora.rank,
             manager.device_bytes / 2**20, device, ", ".join(manager.names) or "none yet")
    return manager
