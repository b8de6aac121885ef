"""Where a decode step's time goes on the GPU: the kernels of a few profiled steps laid on
one time line (torch.profiler's device activity), so a step splits into kernel time by name,
the time the GPU sat idle between kernels, and the kernels that overlap (programmatic
dependent launch lets the next one start before the last ends)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class KernelShare:
    """us_per_step is the kernel's own share of the time line: from the end of everything that
    started before it (or its own start, after a gap) to its end. Its duration would count the
    time a kernel launched early (PDL) waits for the one before, which is that one's."""
    name: str
    us_per_step: float
    launches_per_step: float
    longest_us: float  # the longest such share of one launch


@dataclass
class StepTimeline:
    step_ms: float  # wall time a step, profiler on
    busy_ms: float  # the union of kernel intervals a step
    idle_ms: float  # gaps between kernels a step (step_ms covers the host's share too)
    kernels_per_step: float
    bubbles_per_step: float  # gaps over 5 us a step
    kernels: list[KernelShare] = field(default_factory=list)  # heaviest first
    gaps: list[tuple[float, str, str]] = field(default_factory=list)  # longest idle gaps: (us, before, after)


def device_intervals(prof) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of every kernel, copy and fill the GPU ran, in start order."""
    out = []
    for e in prof.events():  # FunctionEvents: device activity has a CUDA device type
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        out.append((int(e.time_range.start * 1e3), int(e.time_range.end * 1e3), e.name))
    return sorted(out)


def timeline(intervals: list[tuple[int, int, str]], steps: int, top: int = 12) -> StepTimeline:
    """The profiled window is the first kernel's start to the last one's end."""
    if not intervals:
        raise ValueError("no device activity was profiled")
    start, end = intervals[0][0], max(e for _, e, _ in intervals)
    busy = idle = 0
    bubbles = 0
    cur_s, cur_e = intervals[0][0], intervals[0][0]  # the busy run so far; cur_e: everything's end
    per_name: dict[str, list[int]] = defaultdict(list)
    gaps: list[tuple[float, str, str]] = []
    last_name = intervals[0][2]
    for s, e, name in intervals:
        per_name[name].append(max(0, e - max(s, cur_e)))
        if s > cur_e:  # a gap: close the busy run
            busy += cur_e - cur_s
            idle += s - cur_e
            bubbles += (s - cur_e) > 5_000
            gaps.append(((s - cur_e) / 1e3, last_name[:40], name[:40]))
            cur_s = s
        if e >= cur_e:
            last_name = name
        cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    kernels = sorted((KernelShare(name[:72], sum(d) / 1e3 / steps, len(d) / steps, max(d) / 1e3)
                      for name, d in per_name.items()), key=lambda k: -k.us_per_step)
    return StepTimeline(step_ms=(end - start) / 1e6 / steps, busy_ms=busy / 1e6 / steps, idle_ms=idle / 1e6 / steps,
                        kernels_per_step=len(intervals) / steps, bubbles_per_step=bubbles / steps,
                        kernels=kernels[:top], gaps=sorted(gaps, reverse=True)[:top])


def decode_timeline(engine, batch: int, ctx: int, steps: int = 8, warm: int = 8) -> StepTimeline:
    """Profile `steps` decode steps of a batch in steady state (graphs and overlap on, as served):
    the GPU is idle when the profiled window opens and drained when it closes, so every kernel
    in it belongs to those steps."""
    from shared.engine import SamplingParams

    from .gpu_engine import _drain, _set_overlap, start_decoding

    _set_overlap(engine, True)
    params = SamplingParams(temperature=0, max_tokens=warm + steps + 64, ignore_eos=True)
    rids: list = []
    try:
        rids = start_decoding(engine, batch, ctx, params, warm)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
    finally:
        _drain(engine, rids)
        _set_overlap(engine, False)
    return timeline(device_intervals(prof), steps)
