"""Tensor-parallel measurements for `duet bench --suite tp` (needs 2+ GPUs):
TP=2 against TP=1 greedy tokens, the fused one-shot all-reduce + add + RMSNorm against
NCCL all-reduce + the fused add+RMSNorm kernel (both inside CUDA graphs, as decode runs
them), and TP=2 decode steps with the custom all-reduce on and off."""
from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import socket
import sys
import time
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


AR_MODES = ("fused", "barrier", "oneshot")


def _ar_worker(rank: int, world: int, init: str, sizes, hidden: int, queue) -> None:
    try:
        from kernels.rms_norm import rms_norm
        from shared.engine.parallel.custom_all_reduce import CustomAllReduce

        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=dev)
        car = CustomAllReduce(dist.group.WORLD, rank, world, dev)  # one buffer serves every mode
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
            row = dict(tokens=t, bytes=t * hidden * 2, nccl_us=_graph_us(nccl_path))
            for mode in AR_MODES:
                car.mode = mode
                out, res = custom_path()
                row[f"{mode}_diff"] = max((out.float() - ref_out.float()).abs().max().item(),
                                          (res.float() - ref_res.float()).abs().max().item())
                row[f"{mode}_us"] = _graph_us(custom_path)
            car.mode = "fused"
            row["failed_waits"] = car.failed_waits()
            rows.append(row)
        dist.barrier()
        queue.put((rank, rows, None))
    except Exception:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fused_all_reduce_bench(world: int = 2, sizes=(1, 8, 32, 128, 512), hidden: int = 4096) -> list[dict]:
    """Per-call µs (inside CUDA graphs, 20 calls a replay) of each custom all-reduce mode
    fused with add+RMSNorm against NCCL all-reduce + the add+RMSNorm kernel, and each
    mode's largest difference from the NCCL path."""
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


# -- engines in fresh rank-0 processes --------------------------------------------------
# A process that already ran one TP engine cannot set up the fused all-reduce again (see
# custom_all_reduce.py), and a fresh process also returns every byte of GPU memory: each
# TP engine of the bench runs in its own child, which starts its own followers.
def _child(target: str, args, queue) -> None:
    import importlib

    try:
        module, _, name = target.partition(":")
        queue.put(("ok", getattr(importlib.import_module(module), name)(*args)))
    except Exception:  # noqa: BLE001 - reported to the parent
        queue.put(("error", traceback.format_exc()))


def in_fresh_process(target: str, *args, timeout: float = 400.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_child, args=(target, args, queue))
    p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                status, value = queue.get(timeout=2)
                break
            except queue_mod.Empty:
                if not p.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"{target} child ended without a result (exit code {p.exitcode})") from None
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise RuntimeError(value)
    return value


def greedy_tokens(model_dir: str, dtype: str, tp: int, prompts, new_tokens: int, ep: int = 1,
                  quantization: str = "none", kv_cache_dtype: str = "auto") -> list[list[int]]:
    from shared.engine import Engine, SamplingParams

    eng = Engine(model_dir=model_dir, dtype=dtype, tp_size=tp, ep_size=ep, kv_cache_memory=1 << 30,
                 cuda_graph_max_bs=max(8, len(prompts)),  # a short graph ladder: quick to start
                 quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rids = [eng.add_request(p, params) for p in prompts]
    got = {r: [] for r in rids}
    while eng.has_work:
        for out in eng.step():
            got[out.rid] += out.token_ids
    eng.close()
    return [got[r] for r in rids]


def tp_decode_rows(model_dir: str, tp: int, custom_ar: bool, batches, ctx_len: int, steps: int,
                   copy_gb_s: float, ep: int = 1, overlaps=(False,), quantization: str = "none") -> list[dict]:
    import logging

    from .gpu_engine import decode_floor_ms, decode_step_ms, make_engine

    # progress on stderr (this child's report comes back only at its end)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t0 = time.monotonic()
    eng = make_engine(model_dir, load_format="dummy", tp_size=tp, ep_size=ep, custom_all_reduce=custom_ar,
                      max_model_len=4096, cuda_graph_max_bs=max(batches), quantization=quantization)
    active = eng.tp.custom_all_reduce is not None
    print(f"[tp_decode child] TP={tp} EP={ep} custom_ar={active} engine ready in {time.monotonic() - t0:.0f}s",
          file=sys.stderr, flush=True)
    rows = []
    for b in batches:
        floor, _ = decode_floor_ms(eng, b, ctx_len, copy_gb_s)  # per rank
        for overlap in overlaps:
            rows.append(dict(tp=tp, ep=ep, custom_ar=active, batch=b, floor_ms=floor, overlap=overlap,
                             step_ms=decode_step_ms(eng, b, ctx_len, steps, overlap=overlap)))
            print(f"[tp_decode child] B={b} overlap={overlap}: {rows[-1]['step_ms']:.3f} ms", file=sys.stderr,
                  flush=True)
    eng.close()
    return rows
