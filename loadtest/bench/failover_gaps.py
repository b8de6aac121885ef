"""The failover section's arithmetic, from what the client saw: per stream the arrival time of
each token chunk and whether the gateway moved it, and the time the decode worker was killed.

A moved stream's longest inter-token gap is what failover added to it (the kill, the gateway
noticing, the continuation routed, its KV rebuilt, its first token); a bystander (not moved,
still streaming when the worker died) shows what the moves cost the streams that stayed put
(the survivor takes the continuations' prefills and their decode rows)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StreamTimes:
    chunk_times: list[float]  # seconds, one clock for every stream and the kill
    moved: bool  # the gateway continued it elsewhere


@dataclass
class FailoverGaps:
    """Seconds."""

    moved: list[float]  # each moved stream's longest inter-token gap
    bystanders: list[float]  # each bystander's longest inter-token gap
    before_kill: list[float]  # every inter-token gap, of every stream, that ended before the kill


def longest_gap(times: list[float]) -> float | None:
    """The longest gap between consecutive chunks (None below two chunks)."""
    return max((b - a for a, b in zip(times, times[1:])), default=None)


def failover_gaps(streams: list[StreamTimes], killed_at: float) -> FailoverGaps:
    out = FailoverGaps([], [], [])
    for s in streams:
        t = s.chunk_times
        out.before_kill += [b - a for a, b in zip(t, t[1:]) if b <= killed_at]
        gap = longest_gap(t)
        if gap is None:
            continue
        if s.moved:
            out.moved.append(gap)
        elif t[-1] > killed_at:
            out.bystanders.append(gap)
    return out


def ms(values: list[float], q: float) -> float | None:
    """The q-th percentile of seconds, in milliseconds to 0.1 (None when there are none)."""
    return round(1e3 * float(np.percentile(values, q)), 1) if values else None
