"""Where a tensor-parallel decode step spends its time (2+ GPUs).

    python3 -m loadtest.bench.tp_profile [--model qwen3-8b] [--batches 1,32] [--steps 32]

For TP=1 and TP=2 (custom all-reduce on and off), each engine in a fresh rank-0 process:
decode step time as a worker loop sees it, and its parts on rank 0 (scheduling and
planning, sending the plan to the followers, the forward, the logits, sampling) and on
the follower (receive-to-done of its forward), whether the CUDA graphs replayed, and a
torch.profiler table of a few steps on rank 0 (top host and device ops). Prints a short
table last."""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Timers:
    """Host wall time of wrapped calls (the GPU is synchronised where the caller asks)."""

    def __init__(self):
        self.sum = defaultdict(float)
        self.n = defaultdict(int)

    def wrap(self, obj, name: str, label: str, sync: bool = False):
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if sync:
                _sync()
            self.sum[label] += time.perf_counter() - t0
            self.n[label] += 1
            return out
        setattr(obj, name, timed)

    def reset(self):
        self.sum.clear()
        self.n.clear()

    def ms(self) -> dict[str, float]:
        return {k: 1e3 * v / max(self.n[k], 1) for k, v in self.sum.items()}


_FOLLOWER_TIMERS: _Timers | None = None


def follower_instrument(engine) -> bool:
    """Runs on each follower: time its forward (synchronised: a follower runs nothing else)."""
    global _FOLLOWER_TIMERS
    _FOLLOWER_TIMERS = _Timers()
    _FOLLOWER_TIMERS.wrap(engine.runner, "forward_plan", "follower forward_plan (sync)", sync=True)
    graphs = engine.runner.graphs
    if graphs is not None:
        _FOLLOWER_TIMERS.wrap(graphs, "run", "follower graph replays")
    return True


def follower_read(engine, reset: bool = True) -> dict:
    out = dict(_FOLLOWER_TIMERS.ms(), replays=_FOLLOWER_TIMERS.n.get("follower graph replays", 0))
    if reset:
        _FOLLOWER_TIMERS.reset()
    return out


def profile_engine(model: str, tp: int, custom_ar: bool, batches, ctx_len: int, steps: int,
                   workdir: str, device: str = "auto", ar_mode: str = "fused", overlap: bool = False,
                   instrument: bool = True) -> dict:
    """Runs in a fresh process (bench.tp.in_fresh_process)."""
    from pathlib import Path

    import torch

    from .gpu_engine import _drain, make_engine, random_prompts
    from .shapes import config_only_dir
    import numpy as np
    from shared.engine import SamplingParams

    t0 = time.monotonic()
    eng = make_engine(config_only_dir(model, Path(workdir)), load_format="dummy", tp_size=tp, device=device,
                      custom_all_reduce=custom_ar, custom_all_reduce_mode=ar_mode, overlap_schedule=overlap,
                      max_model_len=4096, cuda_graph_max_bs=max(batches),
                      **({"kv_cache_memory": 64 << 20} if device == "cpu" else {}))
    car = eng.tp.custom_all_reduce
    result = dict(tp=tp, custom_ar=car.mode if car is not None else False, overlap=eng.overlap is not None,
                  start_s=time.monotonic() - t0,
                  graphs=sorted(eng.runner.graphs.graphs) if eng.runner.graphs else [], rows=[])
    print(f"[tp_profile] TP={tp} custom_ar={result['custom_ar']} ready in {result['start_s']:.0f}s, "
          f"graphs {result['graphs'][:3]}...", file=sys.stderr, flush=True)
    timers = _Timers()
    if instrument:
        _instrument(eng, timers)
    for b in batches:
        rng = np.random.default_rng(b)
        params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
        rids = [eng.add_request(p, params) for p in random_prompts(rng, eng.model_config.vocab_size, [ctx_len] * b)]
        while any(eng.get(r) is not None and eng.get(r).num_output < 2 for r in rids):
            eng.step()
        for _ in range(8):
            eng.step()
        timers.reset()
        if instrument and eng._tp_workers is not None:
            eng.call_followers("loadtest.bench.tp_profile:follower_read")
        _sync()
        t1 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        _sync()
        step_ms = (time.perf_counter() - t1) / steps * 1e3
        row = dict(batch=b, step_ms=step_ms, **timers.ms(), replays=timers.n.get("rank0 graph replays", 0))
        if instrument and eng._tp_workers is not None:
            row.update(eng.call_followers("loadtest.bench.tp_profile:follower_read")[0])
        if not instrument:  # the step time alone: nothing wrapped, no follower syncs
            result["rows"].append(dict(row, top_cpu="", top_cuda=""))
            print(f"[tp_profile] TP={tp} B={b}: {step_ms:.3f} ms/step (uninstrumented)", file=sys.stderr, flush=True)
            _drain(eng, rids)
            continue
        # a few steps under the profiler on rank 0
        from torch.profiler import ProfilerActivity, profile
        cuda = torch.cuda.is_available()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(5):
                eng.step()
            _sync()
        avg = prof.key_averages()
        row["top_cpu"] = avg.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60)
        row["top_cuda"] = (avg.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60)
                           if cuda else "")
        if cuda:  # the GPU's busy time per step against the step: the rest is gaps between kernels
            busy = sum(e.self_device_time_total for e in avg if e.device_type is not None
                       and str(e.device_type).endswith("CUDA")) / 5 / 1e3
            row["gpu_busy_ms"] = busy
            row["kernels_per_step"] = sum(e.count for e in avg if str(e.device_type).endswith("CUDA")
                                          and e.self_device_time_total > 0) / 5
        result["rows"].append(row)
        print(f"[tp_profile] TP={tp} B={b}: {step_ms:.3f} ms/step", file=sys.stderr, flush=True)
        _drain(eng, rids)
    eng.close()
    return result


def _instrument(eng, timers) -> None:
    """Time rank 0's step parts; each follower times (and synchronises) its forward, which
    stalls an overlapped pipeline: --no-instrument gives the clean step time."""
    timers.wrap(eng.scheduler, "schedule", "rank0 schedule")
    timers.wrap(eng.runner, "forward_plan", "rank0 forward_plan (async)")
    if eng.runner.graphs is not None:
        timers.wrap(eng.runner.graphs, "run", "rank0 graph replays")
    if eng._tp_workers is not None:
        timers.wrap(eng.runner, "plan_sink", "rank0 send_plan")
        eng.call_followers("loadtest.bench.tp_profile:follower_instrument")
    import shared.engine.engine as engine_mod
    timers.wrap(engine_mod, "sample", "rank0 sample (incl. GPU wait)")
    if eng.overlap is not None:
        import shared.engine.overlap as overlap_mod
        timers.wrap(overlap_mod, "sample_on_device", "rank0 sample_on_device")
        timers.wrap(eng.overlap, "_resolve", "rank0 resolve (incl. GPU wait)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.tp_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--configs", default="1:off,2:on,2:off",
                   help="comma list of tp:custom_ar[:mode[:overlap]], e.g. 2:on:oneshot:overlap")
    p.add_argument("--device", default="auto", help="cpu: check the script on a small model (gloo)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    p.add_argument("--no-instrument", action="store_true",
                   help="step times only: no timers, no profiler, no follower syncs")
    a = p.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import tempfile

    from .tp import in_fresh_process

    batches = [int(b) for b in a.batches.split(",")]
    workdir = tempfile.mkdtemp(prefix="tp-profile-")
    results = []
    for cfg in a.configs.split(","):
        tp, car, mode, ovl = (cfg.split(":") + ["", ""])[:4]
        mode = mode or "fused"
        try:
            r = in_fresh_process("loadtest.bench.tp_profile:profile_engine", a.model, int(tp), car == "on",
                                 batches, a.ctx, a.steps, workdir, a.device, mode, ovl == "overlap",
                                 not a.no_instrument, timeout=a.timeout)
        except Exception as e:  # noqa: BLE001 - report and go on with the next config
            print(f"TP={tp} custom_ar={car}: FAILED {e}", flush=True)
            continue
        results.append(r)
        for row in r["rows"]:
            print(f"\n--- TP={r['tp']} custom_ar={r['custom_ar']} overlap={r['overlap']} B={row['batch']} ---\n"
                  f"{row['top_cpu']}\n"
                  f"{row['top_cuda']}", flush=True)
    print("\n=== tp_profile (ms per step; parts are per call) ===")
    for r in results:
        for row in r["rows"]:
            parts = {k: v for k, v in row.items() if k not in ("top_cpu", "top_cuda", "batch", "step_ms")}
            text = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in parts.items())
            print(f"TP={r['tp']} car={r['custom_ar'] or 'off'} overlap={'on' if r['overlap'] else 'off'} "
                  f"B={row['batch']}: step {row['step_ms']:.3f} | "
                  f"start {r['start_s']:.0f}s | {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
