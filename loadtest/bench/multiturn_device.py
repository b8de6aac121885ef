"""KV that outlives the request, measured on this host's GPU.

    python3 -m loadtest.bench.multiturn_device --model qwen3-8b --parts restore,split,colocated
    python3 -m loadtest.bench.multiturn_device --model qwen3-8b --parts hosttier,nocache

Random weights of a real shape (drawn on the GPU from a fixed seed, every worker the same), the
default model's tokenizer, `duet up` on this host's GPUs (one GPU: prefill and decode share it;
two: a GPU each). The workload is `duet loadtest multiturn --workload synthetic`: C conversations,
each with its own ~5.9k-token system prompt, 4 turns in lockstep, 64-token user turns, 48 output
tokens, greedy; each answer fed back into the next prompt. Parts:
- restore: host<->GPU page copies of the host tier (kv_host_tier.py) against one pinned copy of
  the same bytes, measured in this process;
- split / colocated / nocache: 1 prefill + 1 decode, 1 colocated worker, and split with
  --disable-prefix-cache, at each --conversations value: TTFT p50 by turn, cached share, KV the
  prefill worker sent at each turn as a share of those prompts' KV, 429s;
- colocated2 (two GPUs): 2 colocated workers, each on its own GPU, as split's 1 + 1 are there;
- hosttier: split with each worker's GPU KV budget a third of the working set at
  --hosttier-conversations and a host tier large enough for all of it; against split's run at
  the same C (all in GPU).
Prints a short table last; JSON under --out (default $OUT/multiturn-device)."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from .stack_runs import run_each, start_run


@dataclass(frozen=True)
class ChatShape:
    """The synthetic conversations: the issue's shape by default (flags change it)."""

    system_len: int = 5900
    user_len: int = 64
    output_len: int = 48
    turns: int = 4

    @property
    def tokens_per_conversation(self) -> int:
        return self.system_len + self.turns * (self.user_len + self.output_len + 16)  # + template tokens


def kv_bytes_per_token(folder: pathlib.Path, dtype_bytes: int = 2) -> int:
    """bf16 KV (the GPU default); a CPU dry run's fp32 KV reads as twice the share."""
    cfg = json.loads((folder / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads) * head_dim * dtype_bytes


# -- restore speed ------------------------------------------------------------------------------
def restore_speed(model: str, pages: int = 768, page_size: int = 16) -> list[dict]:
    """Host tier save/load of `pages` pages in runs of 8 (a freed-and-reused pool's pattern)
    against one pinned copy of the same bytes, GB/s (median of several)."""
    import torch

    from shared.engine.kv_host_tier import HostKVTier
    from shared.engine.kv_pool import KVLayout, KVPool

    from .shapes import hf_config

    cfg = hf_config(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layout = KVLayout(num_pages=2 * pages + 1, num_layers=cfg.num_hidden_layers,
                      num_kv_heads=cfg.num_key_value_heads, page_size=page_size, head_dim=head_dim,
                      dtype=torch.bfloat16)
    dev = torch.device("cuda")
    pool = KVPool(layout, dev)
    pool.buffer.normal_()
    tier = HostKVTier(pool.buffer, layout, pages)
    g = torch.Generator().manual_seed(0)
    runs = torch.randperm(2 * pages // 8, generator=g)[: pages // 8].tolist()
    dev_pages = [1 + 8 * r + i for r in runs for i in range(8)]
    host_pages = list(range(pages))
    nbytes = pages * layout.bytes_per_page
    flat_host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    flat_dev = torch.empty_like(flat_host, device=dev)

    def timed(fn, reps=5) -> float:
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return statistics.median(out)

    def load():
        event = tier.load(host_pages, dev_pages)
        torch.cuda.current_stream().wait_event(event)
    t_raw_h2d = timed(lambda: flat_dev.copy_(flat_host, non_blocking=True))
    t_raw_d2h = timed(lambda: flat_host.copy_(flat_dev, non_blocking=True))
    t_save = timed(lambda: tier.save(dev_pages, host_pages))
    t_load = timed(load)
    ok = torch.equal(pool.buffer[dev_pages].cpu(), tier.buffer[host_pages])
    gb = nbytes / 1e9
    rows = [dict(part="restore", what="pinned copy host->GPU", gb_s=gb / t_raw_h2d),
            dict(part="restore", what="pinned copy GPU->host", gb_s=gb / t_raw_d2h),
            dict(part="restore", what="host tier load (restore)", gb_s=gb / t_load, of_pinned=t_raw_h2d / t_load,
                 bytes_equal=ok),
            dict(part="restore", what="host tier save (write-back)", gb_s=gb / t_save, of_pinned=t_raw_d2h / t_save)]
    del pool, tier, flat_host, flat_dev
    torch.cuda.empty_cache()
    return rows


# -- stacks -------------------------------------------------------------------------------------
def prefill_metrics_url(log_dir: pathlib.Path) -> str | None:
    """The prefill worker's /metrics, from the registry duet up started."""
    import redis

    from services.launcher.banner import registry_url_in
    url = registry_url_in((log_dir / "up.log").read_text(errors="replace"))  # with the stack's password
    if not url:
        return None
    r = redis.Redis.from_url(url, decode_responses=True)
    for key in r.scan_iter("duet:worker:*"):
        if key.count(":") == 2 and r.hget(key, "role") == "prefill":
            return f"http://{r.hget(key, 'metrics')}/metrics"
    return None


def run_multiturn(url: str, folder: pathlib.Path, out: pathlib.Path, label: str, conversations: int, seed: int,
                  scrape: str | None, shape: ChatShape, max_run_s: float | None = None) -> dict:
    from loadtest.__main__ import main as loadtest_main
    argv = ["multiturn", "--base-url", url, "--tokenizer", str(folder), "--workload", "synthetic",
            "--conversations", str(conversations), "--system-len", str(shape.system_len),
            "--max-turns", str(shape.turns), "--user-len", str(shape.user_len), "--output-len", str(shape.output_len),
            "--mode", "lockstep", "--temperature", "0",
            "--max-context-tokens", "0",
            "--ignore-eos", "on", "--seed", str(seed), "--label", label, "-o", str(out), "--no-progress",
            "--no-plots"]
    if scrape:
        argv += ["--scrape-metrics", scrape]
    if max_run_s:
        argv += ["--duration", str(max_run_s)]  # no turn starts after this
    loadtest_main(argv)  # its exit status says whether every turn finished; the rows below say how
    return json.loads((out / "results.json").read_text())


def turn_rows(doc: dict, stack: str, conversations: int, per_token: int, turns: int) -> dict:
    recs = doc["records"]
    ttft = lambda turns: statistics.median([r["ttft"] for r in recs if r["turn"] in turns and r["ttft"]] or [0])  # noqa: E731
    later = [r for r in recs if r["turn"] >= 1 and r["ok"]]
    prompt = sum(r["input_tokens"] or 0 for r in later)
    cached = sum(r["usage_cached_tokens"] or 0 for r in later)
    moved = None
    rounds = doc.get("round_metrics")
    if rounds:
        def sent(i):
            return sum(v for k, v in next(iter(rounds[i]["series"].values()), {}).items()
                       if k.startswith("duet_kv_transfer_bytes_total") and 'direction="sent"' in k)
        shares = []
        for t in range(1, turns):
            turn_prompt = sum(r["input_tokens"] or 0 for r in recs if r["turn"] == t and r["ok"])
            if turn_prompt and t + 1 < len(rounds):
                shares.append((sent(t + 1) - sent(t)) / (turn_prompt * per_token))
        moved = max(shares) if shares else None
    tpots = [r["tpot"] for r in later if r.get("tpot")]
    return dict(part=stack, conversations=conversations, ttft1_s=ttft({0}), ttft2p_s=ttft(set(range(1, turns))),
                tpot2p_ms=1e3 * statistics.median(tpots) if tpots else None,
                cached2p=cached / prompt if prompt else None, moved2p_max=moved,
                http_429=sum(1 for r in recs if r.get("error_kind") == "http_429"),
                failed=sum(1 for r in recs if not r["ok"]), requests=len(recs))


STACKS = {
    "split": (["--prefill", "1", "--decode", "1"], []),
    "colocated": (["--both", "1", "--prefill", "0", "--decode", "0"], []),
    # two GPUs: two colocated workers, one a GPU (the router pairs each conversation by its cache),
    # against split's prefill and decode each on its own GPU
    "colocated2": (["--both", "2", "--prefill", "0", "--decode", "0"], []),
    "nocache": (["--prefill", "1", "--decode", "1"], ["--disable-prefix-cache"]),
}


def run_stack(name: str, folder: pathlib.Path, args, out: pathlib.Path, conversations: list[int],
              up_extra: list[str] = (), worker_extra: list[str] = ()) -> list[dict]:
    from loadtest.duet_stack import DuetStack

    layout, workers = STACKS["split" if name == "hosttier" else name]
    weights = [] if args.model_dir else ["--load-format", "dummy"]
    worker = [*weights, "--max-model-len", str(args.max_model_len), "--cuda-graph-max-bs", "64",
              *workers, *worker_extra]
    up = [*layout, "--model", str(folder), *up_extra, "--", *worker]
    print(f"== {name}: duet up {' '.join(up)}", file=sys.stderr, flush=True)
    per_token = kv_bytes_per_token(folder)
    rows = []
    t0 = time.monotonic()
    with DuetStack(up, out / name / "logs") as stack:
        ready_s = time.monotonic() - t0
        scrape = prefill_metrics_url(out / name / "logs") if not name.startswith("colocated") else None
        for i, c in enumerate(conversations):
            doc = run_multiturn(stack.url, folder, out / name / f"c{c}", f"{name} C={c}", c, seed=10 * c + i,
                                scrape=scrape, shape=args.shape, max_run_s=args.max_run_s)
            rows.append(dict(turn_rows(doc, name, c, per_token, args.shape.turns), ready_s=ready_s))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _gpus() -> str:
    import torch
    n = torch.cuda.device_count()
    return f"{n} GPU{'s' if n != 1 else ''} ({torch.cuda.get_device_name(0)})" if n else "no GPU"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.multiturn_device", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b", help="shape name (loadtest/bench/shapes.py)")
    p.add_argument("--parts", default="restore,split,colocated,hosttier,nocache")
    p.add_argument("--conversations", default="8,48", help="C values for split, colocated and nocache")
    p.add_argument("--hosttier-conversations", type=int, default=12,
                   help="C of the host-tier run (split runs it too, all in GPU, for the comparison)")
    p.add_argument("--max-model-len", type=int, default=8192)
    d = ChatShape()
    p.add_argument("--system-len", type=int, default=d.system_len)
    p.add_argument("--user-len", type=int, default=d.user_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--max-run-s", type=float, default=None, help="no turn of a run starts after this many seconds")
    p.add_argument("--model-dir", help="a real model folder instead of random weights of --model (dry runs)")
    p.add_argument("--tokenizer-from", default=None, help="folder with tokenizer files (default: the default model's)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "multiturn-device"))
    args = p.parse_args(argv)
    args.shape = shape = ChatShape(args.system_len, args.user_len, args.output_len, args.turns)
    out = start_run(args.out)
    from .stack_gpu import model_folder
    folder = (pathlib.Path(args.model_dir) if args.model_dir
              else model_folder(args.model, pathlib.Path(tempfile.mkdtemp(prefix="mt-device-")), args.tokenizer_from))
    cs = [int(c) for c in args.conversations.split(",") if c]
    hc = args.hosttier_conversations
    working_set = hc * shape.tokens_per_conversation * kv_bytes_per_token(folder)

    def part(name: str) -> list[dict]:
        if name == "restore":
            return restore_speed(args.model)
        if name == "split":
            return run_stack("split", folder, args, out, sorted(set(cs + [hc])))
        if name == "hosttier":  # a third of the working set on the GPU, all of it fits the host tier
            third = f"{working_set // 3 // (1 << 20)}M"
            return run_stack("hosttier", folder, args, out, [hc], up_extra=["--kv-cache-memory", third],
                             worker_extra=["--kv-host-memory", f"{2 * working_set // (1 << 20)}M"])
        return run_stack(name, folder, args, out, cs)

    rows = run_each(args.parts, part)
    (out / "multiturn_device.json").write_text(json.dumps(rows, indent=1, default=str))
    print(f"\n=== multiturn_device: {args.model_dir or args.model}, {shape.turns} turns lockstep, system "
          f"{shape.system_len} + user {shape.user_len} -> {shape.output_len} tokens, {_gpus()} ===")
    for r in rows:
        if r["part"] == "restore":
            extra = f"  {100 * r['of_pinned']:.0f}% of pinned" if "of_pinned" in r else ""
            print(f"restore  {r['what']:<30}{r['gb_s']:>7.1f} GB/s{extra}")
    print(f"{'stack':<10}{'C':>4}{'TTFT t1':>9}{'TTFT t2+':>9}{'TPOT t2+ ms':>12}{'cached t2+':>11}"
          f"{'moved t2+ max':>14}{'429':>5}{'failed':>7}{'ready s':>8}")
    for r in rows:
        if r["part"] == "restore":
            continue
        pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
        tpot = "-" if r.get("tpot2p_ms") is None else f"{r['tpot2p_ms']:.1f}"
        print(f"{r['part']:<10}{r['conversations']:>4}{r['ttft1_s']:>9.2f}{r['ttft2p_s']:>9.3f}{tpot:>12}"
              f"{pct(r['cached2p']):>11}{pct(r['moved2p_max']):>14}{r['http_429']:>5}{r['failed']:>7}"
              f"{r['ready_s']:>8.0f}")
    by = {(r["part"], r["conversations"]): r for r in rows if r["part"] != "restore"}
    for c in cs:
        for other in ("colocated", "colocated2"):
            s, co = by.get(("split", c)), by.get((other, c))
            if s and co and co["ttft2p_s"]:
                print(f"C={c}: split / {other} TTFT turns 2+ p50 = {s['ttft2p_s'] / co['ttft2p_s']:.2f}x")
    s, h = by.get(("split", hc)), by.get(("hosttier", hc))
    if s and h and s["ttft2p_s"]:
        print(f"C={hc}: host tier / all in GPU TTFT turns 2+ p50 = {h['ttft2p_s'] / s['ttft2p_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
