"""The `stack` and `multiturn` sections: whole `duet up` stacks on this host's GPUs (or its CPU),
each started fresh for a layout of --stacks (or the server at --base-url), driven by `duet
loadtest`. Random weights of the last --models shape drawn on the device from a fixed seed (every
worker holds the same model) and the default model's tokenizer, or --model-dir. When both
sections run, they share each layout's stack."""
from __future__ import annotations

import json
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .shapes import config_only_dir

LAYOUTS = {  # `duet up`'s workers (GPU placement: services/launcher/gpus.py); --worker-arg adds e.g. --tp 2
    "colocated": ["--planner", "off", "--both", "1", "--prefill", "0", "--decode", "0"],
    "split": ["--planner", "off", "--prefill", "1", "--decode", "1"],
    "colocated2": ["--planner", "off", "--both", "2", "--prefill", "0", "--decode", "0"],  # as split's two GPUs
    "planned": ["--prefill", "1", "--decode", "1"],  # split's two workers, roles switched by the planner, overflow on
    # the same, started as two `both` workers: beside colocated2 it tells a layout's cost from its history
    "planned2b": ["--both", "2", "--prefill", "0", "--decode", "0"],
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def stack(run) -> None:
    """Per layout: the first `duet loadtest` run after ready, then closed-loop points at each
    --concurrency, random --stack-lens requests: TTFT, TPOT, ITL, output tokens/s, failures; then
    each open-loop rate point's goodput, with the workers' decode-only and mixed steps, the
    router's placements and the planner's switches over the point.
    (The engine's own step at a batch: `--sections decode --batches C --ctx <mean context>`.)"""
    _stacks(run, ("stack", "multiturn") if "multiturn" in run.sections else ("stack",))


def multiturn(run) -> None:
    """Per layout and --conversations count: synthetic conversations of --chat shape, each with
    its own system prompt, turns in lockstep, greedy: by turn, TTFT p50, the share of the prompt
    the server had cached (turns 2+ may find their history there), the prompt, failed turns."""
    if "stack" not in run.sections:  # else it ran with the stack section's stacks
        _stacks(run, ("multiturn",))


def stack_model(run) -> tuple[Path, list[str]]:
    """The model folder and the workers' weight flags: --model-dir, or random weights of the last
    --models shape with a tokenizer, the shape's vocabulary widened to the tokenizer's where it is
    smaller (a CPU shape, qwen3-tiny's 512, under the default model's: the gateway refuses ids past it)."""
    if run.args.model_dir:
        return Path(run.args.model_dir), []
    from transformers import AutoTokenizer

    folder = copy_tokenizer(run, config_only_dir(run.names(run.args.models)[-1], run.root))
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = max(config["vocab_size"], len(AutoTokenizer.from_pretrained(folder)))
    (folder / "config.json").write_text(json.dumps(config))
    return folder, ["--load-format", "dummy"]


def copy_tokenizer(run, folder: Path) -> Path:
    """--tokenizer-from's tokenizer files (default: the default model's) into a random-weight model folder."""
    from shared.model_files.default_model import resolve_model_dir

    src = Path(run.args.tokenizer_from or resolve_model_dir(None))
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, folder / f)
    return folder


def _stacks(run, kinds) -> None:
    from loadtest.duet_stack import DuetStack

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the stack
    folder, weights = stack_model(run)
    if run.args.base_url:
        return _measure(run, kinds, run.args.base_url, folder, "server")
    for layout in run.names(run.args.stacks):
        argv = up_argv(run, LAYOUTS[layout], folder, weights)
        t0 = time.monotonic()
        try:
            with DuetStack(argv, run.root / layout / "logs") as s:
                run.add(kinds[0], f"{layout} ready_s", round(time.monotonic() - t0, 1), f"duet up {' '.join(argv)}")
                _measure(run, kinds, s.url, folder, layout, s.log_dir)
        except Exception as e:  # noqa: BLE001 - the next layout still runs
            run.add(kinds[0], f"{layout} FAILED", f"{type(e).__name__}: {str(e)[:160]}")


def up_argv(run, layout: list[str], folder: Path, weights: list[str], worker: tuple[str, ...] = ()) -> list[str]:
    """`duet up`'s arguments for a layout: --up-arg, the model, and after `--` every worker's flags
    (the weights', a context room for two --stack-lens requests, --worker-arg, `worker`)."""
    prompt, output = run.ints(run.args.stack_lens)
    return [*layout, *run.args.up_arg, "--model", str(folder), "--", *weights, "--max-model-len",
            str(max(8192, 2 * (prompt + output))), *run.args.worker_arg, *worker]


def _measure(run, kinds, url: str, folder: Path, layout: str, log_dir: Path | None = None) -> None:
    if "stack" in kinds:
        _load(run, url, folder, layout, log_dir)
    if "multiturn" in kinds:
        _chats(run, url, folder, layout, log_dir)
        if "stack" in kinds:  # the same load once the chats filled the caches (and the host tier)
            _rates(run, url, folder, layout, log_dir, run.names(run.args.filled_rates), "random", " filled")


@dataclass(frozen=True)
class PlannerActivity:
    """What the stack's planner did so far, from its log: switches, holds for a backlog (a burst
    the current split clears within the dwell), and the decoding streams handed over after
    switches."""

    switches: int = 0
    backlog_holds: int = 0
    handed_over: int = 0

    def since(self, before: "PlannerActivity") -> "PlannerActivity":
        return PlannerActivity(self.switches - before.switches, self.backlog_holds - before.backlog_holds,
                               self.handed_over - before.handed_over)

    def text(self) -> str:
        return (f"{self.switches} planner switches, {self.backlog_holds} backlog holds, "
                f"{self.handed_over} streams handed over")


def planner_activity(log_dir: Path | None) -> PlannerActivity | None:
    """None without a planner."""
    log = log_dir / "planner.log" if log_dir else None
    if not (log and log.is_file()):
        return None
    text = log.read_text(errors="replace")
    return PlannerActivity(text.count("planner switch ("), text.count("planner hold (backlog)"),
                           sum(int(n) for n in re.findall(r"handed (\d+) of \d+ decoding stream", text)))


def workers_sum(log_dir: Path | None, names: list[tuple[str, dict]]) -> list[float]:
    """Each (metric, labels) summed over the stack's workers' /metrics (the ready lines' addresses)."""
    import httpx

    from .stack_metrics import ready_addresses, sample_sum, scrape

    total = [0.0] * len(names)
    for address in {a for f in (sorted(log_dir.glob("*.log")) if log_dir else []) for a in ready_addresses(f)}:
        try:
            samples = scrape(address)
        except httpx.HTTPError:
            continue  # a worker that restarted: its last address
        total = [t + sample_sum(samples, name, **labels) for t, (name, labels) in zip(total, names)]
    return total


ROUTE_KINDS = ("split", "local_prefill", "colocated")


def routes(log_dir: Path | None) -> dict[str, float] | None:
    """The router's placements so far by kind, and how many of the local ones were overflow
    (`duet_router_decisions_total`); None without a router log or its /metrics."""
    import httpx

    from .stack_metrics import router_metrics_address, sample_sum, scrape

    address = router_metrics_address(log_dir) if log_dir else None
    if address is None:
        return None
    try:
        samples = scrape(address)
    except httpx.HTTPError:
        return None
    name = "duet_router_decisions_total"
    return {**{k: sample_sum(samples, name, kind=k) for k in ROUTE_KINDS},
            "overflow": sample_sum(samples, name, reason="overflow")}


def routes_text(before: dict[str, float] | None, after: dict[str, float] | None) -> str:
    """A point's placements, e.g. ", routes split 96, local_prefill 24 (overflow 24), colocated 0"."""
    if before is None or after is None:
        return ""
    d = {k: after[k] - before[k] for k in after}
    return (f", routes split {d['split']:.0f}, local_prefill {d['local_prefill']:.0f} (overflow {d['overflow']:.0f}), "
            f"colocated {d['colocated']:.0f}")


def step_totals(log_dir: Path | None, *phases: str | None) -> tuple[float, ...]:
    """(seconds, steps) of the engine steps of each phase, in one read (decode-only when none is
    given: the step the client's TPOT should match; None: every step), summed over the stack's
    workers."""
    return tuple(workers_sum(log_dir, [(f"duet_engine_step_seconds_{k}", {"phase": phase} if phase else {})
                                       for phase in (phases or ("decode",)) for k in ("sum", "count")]))


def _by_turn(run, label: str, out: Path, log_dir: Path | None, kv_before: list[float]) -> None:
    """A multiturn run's rows by turn (TTFT, TPOT, the prompt's cached share) and the workers' own
    account of its prefix hits by tier."""
    from loadtest.multiturn.results_io import read_result

    for t in read_result(out / "results.json").summary().by_turn:
        run.add("multiturn", f"{label} turn {t.turn + 1} TTFT p50 ms", t.ttft.p50,
                f"p90 {t.ttft.p90}, TPOT p50/p90 {t.tpot.p50}/{t.tpot.p90} ms, cached {t.cache.share}, "
                f"prompt {t.prompt_tokens_mean} tokens, {t.failed} of {t.requests} failed")
    if log_dir is not None:
        kv = workers_sum(log_dir, KV_READING)
        run.add("multiturn", f"{label} KV hit tokens", sum(kv[:2]) - sum(kv_before[:2]), kv_tiers_text(kv_before, kv))


KV_READING = [("duet_kv_cache_hit_tokens_total", {"tier": t}) for t in ("device", "host")] + \
    [("duet_kv_host_tier_pages", {"state": s}) for s in ("usable", "allocated")]


def kv_tiers_text(before: list[float], after: list[float]) -> str:
    """A run's prefix hits by tier, and the host tier's locked (usable) pages at its end."""
    tier = f"{after[2]:.0f} of {after[3]:.0f} host pages usable at the end" if after[3] else "no host tier"
    return f"prefix hits {after[0] - before[0]:.0f} tokens from device, {after[1] - before[1]:.0f} from host; {tier}"


def run_loadtest(argv: list[str], out: Path) -> None:
    from loadtest.__main__ import main as loadtest_main

    loadtest_main([*argv, "-o", str(out), "--no-progress", "--no-plots"])  # the rows say what failed


def _load(run, url: str, folder: Path, layout: str, log_dir: Path | None) -> None:
    from loadtest.results_io import read_results

    prompt, output = run.ints(run.args.stack_lens)
    concs = run.ints(run.args.concurrency)
    for i, c in enumerate([concs[0], *concs] if concs else []):  # the first run after ready, then the sweep
        point = "first run" if i == 0 else f"c={c}"
        out = run.root / layout / f"load{i}"
        run_loadtest(["--base-url", url, "--api", "completions", "--workload", "random", "--input-len", str(prompt),
                      "--output-len", str(output), "-n", str(max(4, 3 * c)), "-c", str(c), "--seed", str(i),
                      "--tokenizer", str(folder), "--label", f"{layout} {point}"], out)
        s = read_results(out / "results.json").summaries()[0]
        run.add("stack", f"{layout} {point} TTFT p50 ms", s.ttft.p50, f"p99 {s.ttft.p99}, TPOT p50 {s.tpot.p50} ms, "
                f"ITL p99 {s.itl.p99} ms, {s.output_throughput:.0f} out tok/s, {s.failed} of {s.requests} failed")
    _rates(run, url, folder, layout, log_dir, run.names(run.args.rates), "random", "")
    _rates(run, url, folder, layout, log_dir, run.names(run.args.sharegpt_rates), "sharegpt", "")


def _rates(run, url: str, folder: Path, layout: str, log_dir: Path | None, rates: list[str], workload: str,
           tag: str) -> None:
    """Open loop: Poisson arrivals at each rate, goodput under --slo (tag: e.g. after the chats filled the caches)."""
    from loadtest.results_io import read_results

    prompt, output = run.ints(run.args.stack_lens)
    ttft_ms, tpot_ms = run.names(run.args.slo)
    for rate in rates:
        out = run.root / layout / f"{workload}{rate}{tag}"
        shape = (["--workload", "sharegpt"] if workload == "sharegpt" else
                 ["--workload", "random", "--input-len", str(prompt), "--output-len", str(output)])

        def load(seconds: float, seed: int, label: str) -> list[str]:
            return ["--base-url", url, "--api", "completions", *shape, "--request-rate", rate, "--duration",
                    str(seconds), "-n", str(int(float(rate) * seconds) + 8), "--seed", str(seed), "--slo-ttft-ms",
                    ttft_ms, "--slo-tpot-ms", tpot_ms, "--tokenizer", str(folder), "--label", f"{layout} {rate}/s{label}"]
        seed = int(float(rate) * 100) + len(tag)
        if run.args.settle_seconds > 0:  # the same load first, unmeasured: a planner picks its split for it
            run_loadtest(load(run.args.settle_seconds, seed + 1, " settling"), out.with_name(out.name + "-settle"))
        before, planned, routed = step_totals(log_dir, "decode", "mixed"), planner_activity(log_dir), routes(log_dir)
        run_loadtest(load(run.args.seconds_per_rate, seed, ""), out)
        s = read_results(out / "results.json").summaries()[0]
        switches = "" if planned is None else f", {planner_activity(log_dir).since(planned).text()}"
        switches += routes_text(routed, routes(log_dir))
        run.add("stack", f"{layout} {workload} {rate}/s{tag} goodput %", round(100 * (s.goodput.share or 0), 1),
                f"TTFT p50/p90 {s.ttft.p50}/{s.ttft.p90}, TPOT p50/p90 {s.tpot.p50}/{s.tpot.p90} ms, ITL p99 "
                f"{s.itl.p99} ms, {s.request_throughput:.2f} req/s, {s.failed} of {s.requests} failed{switches}")
        seconds, steps, mixed_s, mixed = (a - b for a, b in zip(step_totals(log_dir, "decode", "mixed"), before))
        if steps > 0:  # the workers' own decode step over the same window, beside the client's TPOT, and
            # the steps that carried a prompt beside decode rows: what that TPOT pays past the step
            run.add("stack", f"{layout} {workload} {rate}/s{tag} decode step ms", round(1000 * seconds / steps, 2),
                    f"mean of {steps:.0f} decode-only steps; TPOT p50 / step {(s.tpot.p50 or 0) / (1000 * seconds / steps):.2f}")
            run.add("stack", f"{layout} {workload} {rate}/s{tag} mixed step ms", round(1000 * mixed_s / max(mixed, 1), 2),
                    f"mean of {mixed:.0f} steps with prefill beside decode rows")


def _chats(run, url: str, folder: Path, layout: str, log_dir: Path | None = None) -> None:
    from loadtest.multiturn.results_io import read_result

    system, user, output, turns = run.ints(run.args.chat)
    for c in run.ints(run.args.conversations):
        out = run.root / layout / f"chat{c}"
        planned, kv = planner_activity(log_dir), workers_sum(log_dir, KV_READING)
        run_loadtest(["multiturn", "--base-url", url, "--tokenizer", str(folder), "--workload", "synthetic",
                      "--conversations", str(c), "--system-len", str(system), "--user-len", str(user),
                      "--output-len", str(output), "--max-turns", str(turns), "--mode", "lockstep", "--temperature",
                      "0", "--ignore-eos", "on", "--max-context-tokens", "0", "--seed", str(c), "--label",
                      f"{layout} C={c}"], out)
        _by_turn(run, f"{layout} C={c}", out, log_dir, kv)
        if planned is not None:  # what the planner did over the conversations' turns
            did = planner_activity(log_dir).since(planned)
            run.add("multiturn", f"{layout} C={c} planner switches", did.switches, did.text())
    for rate in run.names(run.args.chat_rates):  # chats arriving at a rate, a user's think time between turns
        out = run.root / layout / f"chats{rate}"
        kv = workers_sum(log_dir, KV_READING)
        run_loadtest(["multiturn", "--base-url", url, "--tokenizer", str(folder), "--workload", "synthetic",
                      "--mode", "poisson", "--conversation-rate", rate, "--think-time", str(run.args.think_seconds),
                      "--conversations", str(max(1, round(float(rate) * run.args.seconds_per_rate))),
                      "--system-len", str(system), "--user-len", str(user), "--output-len", str(output),
                      "--max-turns", str(turns), "--temperature", "0", "--ignore-eos", "on", "--max-context-tokens",
                      "0", "--seed", rate, "--label", f"{layout} chats {rate}/s"], out)
        _by_turn(run, f"{layout} chats {rate}/s", out, log_dir, kv)
    for rate in run.names(run.args.agentic_rates):  # agent sessions arriving at a rate: shared prompt, tools
        out = run.root / layout / f"agentic{rate}"
        run_loadtest(["multiturn", "--base-url", url, "--tokenizer", str(folder), "--workload", "agentic", "--mode",
                      "poisson", "--conversation-rate", rate, "--duration", str(run.args.seconds_per_rate),
                      "--conversations", str(int(float(rate) * run.args.seconds_per_rate) + 2), "--temperature", "0",
                      "--max-context-tokens", "0", "--seed", rate, "--system-len", str(system),
                      "--max-turns", str(turns), "--output-len", str(output), "--label", f"{layout} agentic {rate}/s"],
                     out)
        s = read_result(out / "results.json").summary().all_turns
        run.add("multiturn", f"{layout} agentic {rate}/s TTFT p50 ms", s.ttft.p50,
                f"p90 {s.ttft.p90}, TPOT p50/p90 {s.tpot.p50}/{s.tpot.p90} ms, cached {s.cache.share}, "
                f"{s.failed} of {s.requests} failed")
