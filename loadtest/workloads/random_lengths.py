"""Random prompts and output lengths drawn from set distributions."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from loadtest.workloads.request_spec import RequestSpec
from loadtest.workloads.synthetic_text import SyntheticText


@dataclass
class LengthDistribution:
    """Lengths around `mean`: `uniform` over [mean*(1-spread), mean*(1+spread)],
    `normal` with sd mean*spread, `lognormal` with that sigma, or `fixed`."""

    mean: int
    spread: float = 0.0
    kind: str = "uniform"

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed" or self.spread <= 0:
            value = float(self.mean)
        elif self.kind == "uniform":
            value = rng.uniform(self.mean * (1 - self.spread), self.mean * (1 + self.spread))
        elif self.kind == "normal":
            value = rng.gauss(self.mean, self.mean * self.spread)
        elif self.kind == "lognormal":
            # mu chosen so the mean of the distribution is `mean`
            sigma = self.spread
            value = rng.lognormvariate(math.log(self.mean) - sigma * sigma / 2, sigma)
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}")
        return max(1, round(value))


def sample_random(num: int, input_lens: LengthDistribution, output_lens: LengthDistribution, text: SyntheticText,
                  rng: random.Random) -> list[RequestSpec]:
    lengths = [(input_lens.draw(rng), output_lens.draw(rng)) for _ in range(num)]
    return [RequestSpec(user_text=text.text(n_in), output_len=n_out, target_input_len=n_in) for n_in, n_out in lengths]
