"""When conversations start and how long a user (or an agent's tool) takes between turns.

Everything is drawn up front from the seed, so a run's schedule is a value: the same seed
gives the same starts and think times against any server, and tests check it without sleeping."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from loadtest.arrivals import ArrivalProcess

THINK_DISTS = ("exponential", "constant", "uniform", "lognormal")


@dataclass
class ThinkTime:
    """Seconds from an answer's last token to the next turn's send, with mean `mean_s`:
    exponential, constant, uniform over [0, 2 x mean], or lognormal (sigma 1)."""

    mean_s: float = 1.0
    dist: str = "exponential"

    def __post_init__(self) -> None:
        if self.mean_s < 0:
            raise ValueError("think time must be at least 0")
        if self.dist not in THINK_DISTS:
            raise ValueError(f"think-time distribution must be one of {', '.join(THINK_DISTS)}")

    def draw(self, rng: random.Random) -> float:
        if self.mean_s == 0 or self.dist == "constant":
            return self.mean_s
        if self.dist == "exponential":
            return rng.expovariate(1.0 / self.mean_s)
        if self.dist == "uniform":
            return rng.uniform(0.0, 2.0 * self.mean_s)
        sigma = 1.0  # lognormal: mu chosen so the mean is mean_s
        return rng.lognormvariate(math.log(self.mean_s) - sigma * sigma / 2, sigma)


@dataclass
class DialogTiming:
    start_at: float  # seconds from the run's start
    think_s: list[float]  # think_s[t]: the pause after turn t's answer, before turn t + 1


def plan_timing(turn_counts: list[int], rate: float, burstiness: float, think: ThinkTime,
                rng: random.Random) -> list[DialogTiming]:
    """Conversation starts as a Poisson (gamma, with burstiness) process at `rate` per
    second, and every pause between turns, for conversations of the given turn counts."""
    starts = ArrivalProcess(rate, burstiness).times(rng)
    return [DialogTiming(next(starts), [think.draw(rng) for _ in range(max(0, n - 1))]) for n in turn_counts]
