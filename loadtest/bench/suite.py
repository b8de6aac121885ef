"""`duet bench`: the engine measured on random-weight models of real shapes.

    duet bench                                         # ceilings, equality, decode, prefill, offline
    duet bench --sections ceilings,fp8 --budget-s 400  # one GPU
    duet bench --sections tp,tp_fp8,hetero_tp          # a host with two GPUs
    duet bench --sections stack,multiturn --stacks split,colocated
    duet bench --sections saturation --models qwen3-8b --stacks colocated   # one GPU
    duet bench --sections failover --models qwen3-8b --stack-lens 2048,256   # two GPUs
    duet bench --device cpu --models qwen3-small --small-models qwen3-small --ctx 64   # a dry run

Every figure is printed as it is measured and a table comes last (--json keeps them). The
figures of today's code, each with its command and GPU: docs/performance/."""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

SECTIONS = {  # name: (module:function, what it measures)
    "ceilings": ("sections:ceilings", "copy bandwidth, bf16 and FP8 matmul peaks: the floors' denominators"),
    "equality": ("sections:equality", "greedy tokens against transformers on --small-models checkpoints, float32"),
    "decode": ("sections:decode", "decode step ms by batch against its bytes floor; overlap on; graphs off"),
    "prefill": ("sections:prefill", "prefill tokens/s and TFLOP/s against the matmul peak"),
    "offline": ("sections:offline", "random requests queued at once: output tokens/s, overlap off and on"),
    "fp8": ("sections:fp8", "FP8 weights, and FP8 weights + FP8 KV, against bf16: decode and prefill"),
    "spec": ("sections:spec", "speculative decoding at batch 1: the accept-all ceiling, greedy tokens equal"),
    "lora": ("lora:lora", "LoRA adapters in the batch (0, 1, 8 distinct): decode steps and prefill against no LoRA"),
    "tp": ("tp:tp", "TP=2 against TP=1: greedy tokens (MoE: EP=2 too), decode steps (two GPUs)"),
    "tp_fp8": ("tp_fp8:tp_fp8", "FP8 weights, FP8 KV, the host tier at TP=2: greedy tokens against TP=1, decode steps"),
    "hetero_tp": ("hetero_tp:hetero_tp", "`duet up --prefill-tp 2 --decode-tp 1` against 1 -> 1: the KV handoff "
                  "tail by prompt length, greedy tokens"),
    "stack": ("stacks:stack", "`duet up` stacks under `duet loadtest`: TTFT, TPOT, ITL, tokens/s, the first run"),
    "multiturn": ("stacks:multiturn", "`duet up` stacks under `duet loadtest multiturn`: TTFT by turn, cache"),
    "saturation": ("saturation:saturation", "ShareGPT sent all at once through `duet up` beside the engine's offline "
                   "throughput on the same requests: output tokens/s, the ratio, engine step, CPU per token"),
    "failover": ("failover:failover", "`duet up` with two decode workers, one SIGKILLed under streams: the moved "
                 "streams' longest gap, KV rebuilt moved against recomputed, tokens against unfaulted"),
}
DEFAULT_SECTIONS = "ceilings,equality,decode,prefill,offline"


@dataclass
class Run:
    """What every section gets: the arguments, the device, a scratch folder; and the report
    each adds its rows to."""

    args: argparse.Namespace
    dev: object
    root: Path
    sections: list[str]
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    ceilings: object = None

    def add(self, section: str, what: str, value, note: str = "") -> None:
        text = (f"{value:.3f}" if isinstance(value, float) else str(value)) + (f"  ({note})" if note else "")
        self.rows.append((section, what, text))
        self.data.setdefault(section, {})[what] = value
        print(f"[{section}] {what}: {text}", flush=True)

    def table(self) -> str:
        w0, w1 = (max((len(r[i]) for r in self.rows), default=8) for i in (0, 1))
        return "\n".join(f"{s:<{w0}}  {k:<{w1}}  {v}" for s, k, v in self.rows)

    def names(self, text: str) -> list[str]:
        return [x for x in text.split(",") if x]

    def ints(self, text: str) -> list[int]:
        return [int(x) for x in self.names(text)]

    def need_ceilings(self):
        if self.ceilings is None:
            importlib.import_module(".sections", __package__).ceilings(self)
        return self.ceilings


def parser() -> argparse.ArgumentParser:
    sections = "\n".join(f"  {name:<10} {what}" for name, (_, what) in SECTIONS.items())
    p = argparse.ArgumentParser(prog="duet bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"sections (run in the order --sections gives):\n{sections}")
    a = p.add_argument
    a("--sections", default=DEFAULT_SECTIONS, help=f"comma list (default {DEFAULT_SECTIONS})")
    a("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the sections")
    a("--models", default="qwen3-0.6b,qwen3-8b", help="shapes (shapes.py) for decode, prefill, fp8; "
      "offline and hetero_tp take the first, spec the last as its target and the first as its draft, tp, tp_fp8, "
      "stack and failover the last")
    a("--small-models", default="qwen3-small,llama-small,qwen3-moe-small",
      help="random checkpoints: equality, tp, tp_fp8")
    a("--batches", default="1,8,32,128")
    a("--ctx", type=int, default=1024, help="context of the timed decode steps")
    a("--steps", type=int, default=32, help="timed decode steps a point")
    a("--prefill-prompts", default="1,4,16")
    a("--prefill-len", type=int, default=2048)
    a("--lora-rank", type=int, default=16, help="lora: the adapters' rank (every linear adapted)")
    a("--offline-requests", type=int, default=256, help="prompt and output lengths uniform in [ctx/10, ctx]")
    a("--stacks", default="colocated,split",
      help="stack, multiturn, saturation: colocated, split, colocated2 (two GPUs), planned (split, the planner on), "
           "planned2b (two `both` workers, the planner on)")
    a("--concurrency", default="1,16,32", help="stack: closed-loop points")
    a("--stack-lens", default="1024,256", help="stack, failover: prompt and output tokens")
    a("--rates", default="", help="stack: Poisson rates (req/s) of --stack-lens prompts, --seconds-per-rate each, "
      "goodput under --slo")
    a("--sharegpt-rates", default="", help="stack: the same with ShareGPT's single turns")
    a("--filled-rates", default="", help="stack with multiturn: rates run again after the chats filled the caches")
    a("--seconds-per-rate", type=float, default=20.0)
    a("--settle-seconds", type=float, default=0.0, help="stack: before each rate point, the same load this long "
      "unmeasured (a planned stack's planner switches for it first: give it its window plus its dwell)")
    a("--saturation", default="1000", help="saturation: ShareGPT requests[,output tokens each] (default their own)")
    a("--slo", default="2000,15", help="stack, multiturn: TTFT and TPOT targets, ms")
    a("--conversations", default="8,48", help="multiturn: conversations a run")
    a("--agentic-rates", default="", help="multiturn: agentic sessions started per second, --seconds-per-rate each")
    a("--chat", default="5900,64,48,4", help="multiturn: system, user, output tokens, turns (lockstep, --chat-rates)")
    a("--chat-rates", default="", help="multiturn: --chat conversations started per second (Poisson), --seconds-per-rate "
      "of starts each, every one to its last turn, --think-seconds between an answer and the next turn")
    a("--think-seconds", type=float, default=10.0, help="multiturn, --chat-rates: mean think time (exponential)")
    a("--base-url", help="stack, multiturn, saturation: measure this running server instead of starting --stacks")
    a("--model-dir", help="stack, multiturn, saturation, failover: a real model folder instead of random weights of the last --models")
    a("--tokenizer-from", help="stack, multiturn, failover: tokenizer files for random weights (default the default model's)")
    a("--worker-arg", action="append", default=[], help="stack, multiturn, failover: a flag for every worker (repeat)")
    a("--up-arg", action="append", default=[], help="stack, multiturn, failover: a flag for `duet up`, e.g. --up-arg=--slo-itl-ms=15")
    a("--failover-modes", default="moved,recomputed", help="failover: moved (the workers as configured), "
      "recomputed (every worker --disable-prefix-cache: a moved stream's KV computed again from scratch)")
    a("--failover-streams", type=int, default=64, help="failover: concurrent streams of --stack-lens")
    a("--failover-after", type=int, default=32, help="failover: the kill once every stream has this many tokens")
    a("--hetero-lens", default="", help="hetero_tp: prompt lengths (default 4096,16384 on GPUs, 96,320 on the CPU)")
    a("--hetero-layouts", default="2->1,1->1", help="hetero_tp: prefill->decode TP sizes")
    a("--hetero-trials", type=int, default=2, help="hetero_tp: measured prompts a length")
    a("--hetero-dtype", default="float32", help="hetero_tp: the workers' and the offline engine's dtype")
    a("--json", help="write the figures here")
    a("--workdir", help="scratch folder (default a new temporary one)")
    a("--budget-s", type=float, help="seconds for the run: later sections are skipped, a hung one cut off")
    return p


def _report(run: Run, title: str) -> None:
    if run.args.json:
        Path(run.args.json).write_text(json.dumps(run.data, indent=1, default=str))
    print(f"\n=== {title} ===\n" + run.table(), flush=True)


def _watchdog(deadline: float, run: Run) -> None:
    """Past the deadline, print what was measured and leave: a hung kernel cannot swallow the run."""
    spent = f"duet bench: budget of {run.args.budget_s:.0f}s spent"
    timer = threading.Timer(max(1.0, deadline - time.monotonic()), lambda: (_report(run, spent), os._exit(3)))
    timer.daemon = True
    timer.start()


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    if unknown := [s for s in sections if s not in SECTIONS]:
        p.error(f"unknown sections {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error"), ("NCCL_NVLS_ENABLE", "0"),
                       ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        os.environ.setdefault(key, value)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("duet bench: error: needs a CUDA GPU (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    start = time.monotonic()
    run = Run(args, torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"),
              Path(args.workdir or tempfile.mkdtemp(prefix="duet-bench-")), sections)
    props = torch.cuda.get_device_properties(run.dev) if args.device == "cuda" else None
    run.add("env", "device", f"{props.name} x{torch.cuda.device_count()}, {props.total_memory / 2**30:.0f} GiB"
            if props else f"CPU, {os.cpu_count()} cores", f"torch {torch.__version__}")
    if args.budget_s:
        _watchdog(start + args.budget_s + 20, run)
    for name in sections:
        t0 = time.monotonic()
        if args.budget_s and t0 - start > args.budget_s - 15:
            run.add(name, "skipped", f"budget: {t0 - start:.0f} of {args.budget_s:.0f}s spent")
            continue
        module, _, function = SECTIONS[name][0].partition(":")
        try:
            getattr(importlib.import_module(f".{module}", __package__), function)(run)
        except Exception as e:  # noqa: BLE001 - one failing section must not hide the others
            traceback.print_exc()
            run.add(name, "FAILED", f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:160]}")
        run.add(name, "section_sec", round(time.monotonic() - t0, 1))
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    _report(run, "duet bench")
    return 0
