"""When requests are sent: a Poisson or gamma process at a set rate, all at once
(rate = inf, usually with a concurrency cap), or the timestamps of a trace."""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Iterator


@dataclass
class ArrivalProcess:
    """Gamma-distributed gaps with mean 1/rate. burstiness is the gamma shape: 1 is
    Poisson, below 1 clumps arrivals into bursts, above 1 spaces them more evenly
    (the knob vLLM's benchmark calls burstiness)."""

    rate: float  # requests per second; math.inf sends everything at time 0
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError("request rate must be positive (use inf for no pacing)")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be positive")

    def gaps(self, rng: random.Random) -> Iterator[float]:
        scale = 1.0 / (self.rate * self.burstiness)
        while True:
            yield 0.0 if math.isinf(self.rate) else rng.gammavariate(self.burstiness, scale)

    def times(self, rng: random.Random) -> Iterator[float]:
        """Send times from 0: the first request goes at once."""
        return itertools.accumulate(self.gaps(rng), initial=0.0)


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def rate_to_json(rate: float) -> float | str | None:
    """JSON has no inf or nan: "inf" (unpaced) and None (a trace's own times)."""
    return "inf" if math.isinf(rate) else (None if math.isnan(rate) else rate)


def rate_from_json(value) -> float:
    return math.inf if value == "inf" else (math.nan if value is None else float(value))
