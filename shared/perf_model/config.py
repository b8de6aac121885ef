"""Settings of the performance model and the latency targets (shared/settings).

`ItlTarget` is nested by the router and by every worker, so one `--slo-itl-ms` /
`DUET_SLO_ITL_MS` sets the target on both sides of the decision: the router keeps a decode
worker's predicted step under it when it places a prefill there, and the worker's scheduler
keeps its steps under it when it mixes prefill chunks into decode steps. `TtftTarget` is nested by
the planner and by every worker: the planner weighs splits against it, and a worker's step budget
widens its prefill chunks when its queue would miss it (step_budget.py)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.settings.spec import nested, setting

# the target when none is set: a GPU decode step of a mid-sized model runs 10-20 ms, so 30 ms
# leaves room for prefill chunks beside it; a CPU step of the default model is far slower
GPU_DEFAULT_ITL_S = 0.030
CPU_DEFAULT_ITL_S = 0.250


@dataclass
class ItlTarget:
    itl_ms: float = setting(
        0.0, flag="--slo-itl-ms", env="DUET_SLO_ITL_MS",
        help="inter-token latency target in ms: a decode worker mixes prefill chunks into decode steps only as "
             "far as its steps stay under it, and the router places a prefill on a decode worker only where it "
             "does; 0 = each worker's default (30 ms on a GPU, 250 ms on CPU), which the router reads from the "
             "registry")


def default_itl_s(device_type: str) -> float:
    return GPU_DEFAULT_ITL_S if device_type == "cuda" else CPU_DEFAULT_ITL_S


# a chat product's first token: within a second on a GPU (the reader is waiting for the answer
# to start); a CPU prefill of the default model runs ~100 times slower per token
GPU_DEFAULT_TTFT_S = 1.0
CPU_DEFAULT_TTFT_S = 5.0


@dataclass
class TtftTarget:
    ttft_ms: float = setting(
        0.0, flag="--slo-ttft-ms", env="DUET_SLO_TTFT_MS",
        help="time-to-first-token target in ms: the planner keeps the worker split to it (with --slo-itl-ms), "
             "and a worker whose queued prefills would miss it at the inter-token budget's room takes wider "
             "prefill chunks beside its decode rows (--itl-budget-ttft); 0 = 1000 ms on GPU workers, 5000 ms "
             "on CPU ones")

    def target_s(self, on_gpu: bool) -> float:
        if self.ttft_ms > 0:
            return self.ttft_ms / 1000
        return GPU_DEFAULT_TTFT_S if on_gpu else CPU_DEFAULT_TTFT_S


@dataclass
class PerfModelConfig:
    """A worker's step-time model and its prefill budget beside decode rows."""

    calibrate: bool = setting(
        True, flag="--perf-calibrate", env="DUET_PERF_CALIBRATE",
        help="time a few engine steps of different shapes at start (after warm-up, before registering) to fit "
             "the step-time model the router and the prefill budget use; off: the model comes from live steps "
             "only, and until it has enough the router places by threshold and steps carry the full token budget")
    calibration_cache: str = setting(
        "", flag="--perf-calibration-cache", env="DUET_PERF_CALIBRATION_CACHE",
        help="folder where start-up calibrations are kept, one per checkpoint, device, engine plan and step "
             "limits: a worker started again with the same ones reuses its timed steps instead of timing them "
             "(live steps still correct the model); '' = <cache dir>/calibration, 'off' = time every start")
    itl_budget: bool = setting(
        True, flag="--itl-budget", env="DUET_ITL_BUDGET",
        help="limit the prefill chunks a step carries beside decode rows so the step stays under the "
             "inter-token latency target (off: the token budget alone, --max-num-batched-tokens)")
    budget_ttft: bool = setting(
        True, flag="--itl-budget-ttft", env="DUET_ITL_BUDGET_TTFT",
        help="weigh the prefill queued on the worker in the inter-token budget: when the queue cannot meet "
             "the time-to-first-token target (--slo-ttft-ms) at the room the inter-token target leaves, a step "
             "beside decode rows takes as many prefill tokens as the step model says the queue needs, up to "
             "the token budget (off: the inter-token target alone sets the room)")
    budget_floor_tokens: int = setting(
        32, flag="--itl-budget-floor", env="DUET_ITL_BUDGET_FLOOR",
        help="prefill tokens a step beside decode rows carries at least, whatever the target says, so a "
             "prefill on a busy decode worker still progresses")
    slo: ItlTarget = nested(ItlTarget)
    ttft: TtftTarget = nested(TtftTarget)
