"""CUDA graphs for decode steps: capture a ladder of batch sizes once, replay per step.

A decode step of a small model is hundreds of tiny kernels; launching them one by one
from Python costs more than running them. Each captured graph covers batch sizes up to
its own: a step of n sequences pads up to the next captured size (padded rows are made
harmless by the backend's replay_metadata) and replays. Graphs share one memory pool and
are captured largest first, so the smaller ones reuse the larger ones' memory.

With capture=False (--disable-cuda-graph) the same padded static buffers are used and the
same kernels run, launched one by one: graphs on and off then compute identical numbers
(same shapes, so the same GEMM algorithms and attention split counts), and the timing
difference is launch overhead alone."""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("duet.engine.cuda_graph")


def batch_size_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond (as SGLang)."""
    sizes = [1, 2, 4, 8]
    sizes += list(range(16, 65, 8)) + list(range(80, 257, 16)) + list(range(288, max(max_bs, 288) + 1, 32))
    out = sorted({s for s in sizes if s <= max_bs})
    if not out or out[-1] != max_bs:
        out.append(max_bs)
    return out


def capture_graph(device, pool_handle, run):
    """(graph, its output) for `run()` captured on `device` into the memory pool `pool_handle`."""
    # warm up outside the graph: Triton compiles, cuBLAS picks kernels, NCCL connects
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: only this thread's unsafe calls break the capture. The host tier's pinning
    # thread registers memory (cudaHostRegister) meanwhile, which under the default global mode
    # invalidated the capture and failed the registration (error 900) on 2 x H200
    with torch.cuda.graph(graph, pool=pool_handle, capture_error_mode="thread_local"):
        out = run()
    return graph, out


def capture_ladder(device, keys, run, before=None) -> tuple[dict, dict]:
    """({key: graph}, {key: its output}) for run(key) over keys, captured largest first into one
    memory pool (the smaller graphs reuse the larger ones' memory); before(key), if given,
    fills the static buffers for that key's capture."""
    graphs, outputs = {}, {}
    pool_handle = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        for key in sorted(keys, reverse=True):
            if before is not None:
                before(key)
            graphs[key], outputs[key] = capture_graph(device, pool_handle, lambda k=key: run(k))
    torch.cuda.synchronize(device)
    return graphs, outputs


class CudaGraphRunner:
    def __init__(self, model, backend, pool, device: torch.device, max_bs: int, max_pages: int,
                 sizes: list[int] | None = None, capture: bool = True):
        from .model_runner import ForwardBatch

        self.model = model
        self.backend = backend
        self.device = device
        self.sizes = sorted(sizes) if sizes else batch_size_ladder(max_bs)
        self.max_bs = self.sizes[-1]
        self.max_pages = max_pages
        backend.init_graph_state(self.max_bs, max_pages)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._forward_batch = ForwardBatch
        self.capture = capture
        if not capture:
            return
        t0 = time.monotonic()
        free_before = torch.cuda.mem_get_info(device)[0]
        self.pool_handle = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                self._capture(bs)
        torch.cuda.synchronize(device)
        self.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs, %.0f MiB", len(self.sizes),
                 self.sizes[0], self.max_bs, time.monotonic() - t0, self.memory_bytes / 2**20)

    def _run_model(self, bs: int):
        meta = self.backend.capture_metadata(bs)
        return self.model(self.input_ids[:bs], self.positions[:bs], self._forward_batch(self.backend, meta))

    def _capture(self, bs: int) -> None:
        self.graphs[bs], self.outputs[bs] = capture_graph(self.device, self.pool_handle, lambda: self._run_model(bs))

    def padded_size(self, n: int) -> int | None:
        for s in self.sizes:
            if s >= n:
                return s
        return None

    def can_run(self, batch, meta) -> bool:
        return (meta.is_decode and meta.batch_size <= self.max_bs
                and meta.page_table.shape[1] <= self.max_pages)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Hidden states [n, hidden] of the step (a view of the graph's output buffer,
        valid until the next replay)."""
        n = meta.batch_size
        bs = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.backend.replay_metadata(meta, bs)
        if not self.capture:
            return self._run_model(bs)[:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
