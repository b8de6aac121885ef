"""The `saturation` section: ShareGPT single turns, all queued at once (twice the running batches
in flight), through `duet up` (each --stacks layout, or the server at --base-url) beside the
engine's own offline throughput on the same requests and the same GPU, both in one run: output
tokens/s and their ratio to offline per GPU, TPOT, the workers' mean engine step against the wall
time per step (the gap is the worker's time between steps), and each process's CPU per output
token (where the stack, not the GPU, is the limit)."""
from __future__ import annotations

import time
from pathlib import Path

from .measure import generate, with_engine
from .shapes import sync
from .stack_metrics import ready_addresses
from .stacks import LAYOUTS, run_loadtest, stack_model, step_totals, up_argv

PROCESS_KINDS = ("gateway", "router", "worker", "planner", "redis")
ROWS_PER_WORKER = 256  # the engine's default --max-running-requests


def saturation(run) -> None:
    from loadtest.duet_stack import DuetStack
    from loadtest.results_io import read_results

    folder, weights = stack_model(run)
    requests, prompts, outputs = _requests(run, folder)
    offline = _offline(run, prompts, outputs)

    def measure(url: str, label: str, gpus: int, stack=None) -> None:
        base = ["--base-url", url, "--api", "completions", "--workload", "sharegpt", "--seed", "1", "--tokenizer",
                str(folder), *_output_len(run)]
        run_loadtest([*base, "-n", "32", "-c", "32", "--label", f"{label} warm-up"], run.root / label / "warm")
        logs = stack.log_dir if stack else None
        steps0, cpu0 = step_totals(logs, None), _cpu_seconds(stack)
        t0 = time.monotonic()
        conc = min(requests, 2 * ROWS_PER_WORKER * gpus)  # the running batches full, the gateway's queue fed
        run_loadtest([*base, "-n", str(requests), "-c", str(conc), "--label", f"{label} saturation"],
                     run.root / label / "saturation")
        wall = time.monotonic() - t0
        s = read_results(run.root / label / "saturation" / "results.json").summaries()[0]
        per_gpu = s.output_throughput / gpus
        run.add("saturation", f"{label} out tok/s", round(s.output_throughput, 1),
                f"{per_gpu / offline:.2f}x offline per GPU ({gpus} GPU), TPOT p50 {s.tpot.p50 or 0:.1f} ms, TTFT p50 "
                f"{s.ttft.p50 or 0:.0f} ms, {s.failed} of {s.requests} failed")
        run.add("saturation", f"{label} / offline per GPU", round(per_gpu / offline, 3))
        seconds, steps = (a - b for a, b in zip(step_totals(logs, None), steps0))
        if steps > 0:
            run.add("saturation", f"{label} engine step ms", round(1000 * seconds / steps, 2),
                    f"wall per step {1000 * wall * _workers(logs) / steps:.2f} ms over {steps:.0f} steps, "
                    f"{s.output_tokens / steps:.0f} output tokens a step")
        if stack is not None and s.output_tokens:
            used = {k: v - cpu0.get(k, 0.0) for k, v in _cpu_seconds(stack).items()}
            run.add("saturation", f"{label} CPU us per output token", round(1e6 * sum(used.values()) / s.output_tokens),
                    ", ".join(f"{k} {1e6 * v / s.output_tokens:.0f} ({100 * v / wall:.0f}% of a core)"
                              for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0))

    if run.args.base_url:
        return measure(run.args.base_url, "server", 1)
    for layout in run.names(run.args.stacks):
        argv = up_argv(run, LAYOUTS[layout], folder, weights)
        try:
            with DuetStack(argv, run.root / layout / "logs") as stack:
                measure(stack.url, layout, _gpus(LAYOUTS[layout]), stack)
        except Exception as e:  # noqa: BLE001 - the next layout still runs
            run.add("saturation", f"{layout} FAILED", f"{type(e).__name__}: {str(e)[:160]}")


def _output_len(run) -> list[str]:
    fixed = run.ints(run.args.saturation)[1:]
    return ["--sharegpt-output-len", str(fixed[0])] if fixed else []


def _requests(run, folder: Path) -> tuple[int, list[list[int]], list[int]]:
    """The ShareGPT requests `duet loadtest --seed 1` sends, as the engine's token ids and output lengths."""
    from loadtest.config import WorkloadConfig
    from loadtest.tokenizer_source import TokenCounter, load_tokenizer
    from loadtest.workloads.build import build_workload

    n, *fixed = run.ints(run.args.saturation)
    counter = TokenCounter(load_tokenizer(str(folder)))
    specs = build_workload(WorkloadConfig(name="sharegpt", num_requests=n, seed=1,
                                          sharegpt_output_len=fixed[0] if fixed else None), counter)
    return n, [counter.tokenizer(s.user_text)["input_ids"] for s in specs], [s.output_len for s in specs]


def _offline(run, prompts: list[list[int]], outputs: list[int]) -> float:
    """The engine alone on the requests, every one queued at once (its default settings): output tokens/s."""
    model = run.args.model_dir or run.names(run.args.models)[-1]

    def measure(eng) -> float:
        generate(eng, prompts[:32], 16)  # compiles and graph pools, as the stack's warm-up does
        sync(eng.device)
        t0, steps0 = time.perf_counter(), eng.scheduler.num_batches
        generate(eng, prompts, outputs)
        sync(eng.device)
        sec, steps = time.perf_counter() - t0, eng.scheduler.num_batches - steps0
        run.add("saturation", "offline out tok/s", round(sum(outputs) / sec, 1),
                f"{len(prompts)} ShareGPT requests, {sum(map(len, prompts))} prompt and {sum(outputs)} output tokens "
                f"in {sec:.1f}s, {steps} steps of {1000 * sec / max(1, steps):.2f} ms, "
                f"{sum(outputs) / max(1, steps):.0f} output tokens a step")
        return sum(outputs) / sec

    return with_engine(run, model, measure)


def _gpus(layout: list[str]) -> int:
    """GPUs a layout's workers take: one each (`duet up`'s --both, --prefill, --decode counts)."""
    return sum(int(layout[i + 1]) for i, a in enumerate(layout) if a in ("--both", "--prefill", "--decode")) or 1


def _workers(logs: Path | None) -> int:
    """Workers that logged a ready line (each steps on its own GPU: wall time counts once a worker)."""
    return max(1, sum(bool(ready_addresses(f)) for f in sorted(logs.glob("*.log")))) if logs else 1


def _cpu_seconds(stack) -> dict[str, float]:
    """User + system CPU seconds so far of each kind of process `duet up` started."""
    if stack is None:
        return {}
    import psutil

    used: dict[str, float] = {}
    for p in psutil.Process(stack.proc.pid).children(recursive=True):
        try:
            words = " ".join(p.cmdline()[:5])
            t = p.cpu_times()
        except psutil.Error:
            continue
        kind = next((k for k in PROCESS_KINDS if k in words), "other")
        used[kind] = used.get(kind, 0.0) + t.user + t.system
    return used
