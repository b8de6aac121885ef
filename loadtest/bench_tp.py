"""Tensor-parallel measurements for `duet bench --suite tp` (needs 2+ GPUs):
TP=2 against TP=1 greedy tokens, the fused one-shot all-reduce + add + RMSNorm against
NCCL all-reduce + the fused add+RMSNorm kernel (both inside CUDA graphs, as decode runs
them), and TP=2 decode steps with the custom all-reduce on and off."""
from __future__ import annotations

import multiprocessing as mp
import socket
import traceback

import torch
import torch.distributed as dist


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _graph_us(fn, calls: int = 20, reps: int = 20) -> float:
    """Per-call µs of `fn` captured `calls` times in one CUDA graph, median of replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def _ar_worker(rank: int, world: int, init: str, sizes, hidden: int, queue) -> None:
    try:
        from kernels.rms_norm import rms_norm
        from shared.engine.custom_all_reduce import CustomAllReduce

        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=dev)
        car = CustomAllReduce(dist.group.WORLD, rank, world, dev)
        car.self_check()
        g = torch.Generator(device=dev).manual_seed(0)
        weight = (1 + 0.1 * torch.randn(hidden, generator=g, device=dev)).to(torch.bfloat16)
        rows = []
        for t in sizes:
            residual = torch.randn(t, hidden, generator=g, device=dev).to(torch.bfloat16)
            torch.manual_seed(100 + rank)
            x = torch.randn(t, hidden, device=dev).to(torch.bfloat16)
            buf = torch.empty_like(x)

            def nccl_path():
                buf.copy_(x)
                dist.all_reduce(buf)
                return rms_norm(buf, weight, 1e-6, residual)

            def custom_path():
                return car.all_reduce_add_rms_norm(x, residual, weight, 1e-6)

            ref_out, ref_res = nccl_path()
            out, res = custom_path()
            err = max((out.float() - ref_out.float()).abs().max().item(),
                      (res.float() - ref_res.float()).abs().max().item())
            rows.append(dict(tokens=t, bytes=t * hidden * 2, max_abs_diff=err,
                             nccl_us=_graph_us(nccl_path), custom_us=_graph_us(custom_path)))
        dist.barrier()
        queue.put((rank, rows, None))
    except Exception:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fused_all_reduce_bench(world: int = 2, sizes=(1, 8, 32, 128, 512), hidden: int = 4096) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{_port()}"
    procs = [ctx.Process(target=_ar_worker, args=(r, world, init, list(sizes), hidden, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    for rank, rows, err in results:
        if err:
            raise RuntimeError(f"rank {rank}:\n{err}")
    return next(rows for rank, rows, _ in results if rank == 0)
