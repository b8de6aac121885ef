"""How long one engine step takes, by what it carries: a worker's performance model.

    step_s = base + a * prefill_tokens + b * attended_pairs + c * decode_rows + d * decode_context

`prefill_tokens` pay the weights' matmuls per token; `attended_pairs` (a chunk of L tokens
after `start` held ones attends to L * (start + (L + 1) / 2) positions) pay prefill attention,
which grows with the context a chunk extends; every decode row pays its sampling and share of
the matmuls, and its context (`decode_context`, the positions decode rows attend to) pays
decode attention and KV reads. `base` is what a step costs whatever it holds (reading the
weights, launches, host work). Linear in its coefficients, so it fits by least squares
(linear_fit.py) from timed steps; coefficients are kept non-negative, so a prediction never
shrinks as a step carries more (the Dynamo planner's and DistServe's latency models take the
same terms, interpolated from profiles instead of fitted)."""
from __future__ import annotations

import math
from dataclasses import dataclass

# feature scales: each term's unit, so the fit's matrix stays well conditioned
_TOKENS, _PAIRS, _CONTEXT = 1e3, 1e6, 1e3
TERMS = ("base_s", "prefill_token_s", "attended_pair_s", "decode_row_s", "context_token_s")
# the fit's pull toward its prior, per term (linear_fit.py): the attention terms are small next
# to the others unless contexts are long, and a few noisy steps (a calibration cut short, a
# single stream whose context grows while the machine's load drifts) would otherwise hand them
# what noise the first-order terms leave; a few per cent is all they lose with plenty of data
RIDGE = (1e-4, 1e-4, 0.02, 1e-4, 0.02)
_UNIT = (1.0, _TOKENS, _PAIRS, 1.0, _CONTEXT)  # coefficient per feature unit -> per natural unit


def attended_pairs(start: int, length: int) -> float:
    """Query-key pairs a prefill chunk of `length` tokens after `start` held ones computes."""
    return length * (start + (length + 1) / 2)


@dataclass(frozen=True)
class StepShape:
    """What one engine step computes."""

    prefill_tokens: int = 0       # prompt tokens (chunks) computed this step
    attended_pairs: float = 0.0   # sum of attended_pairs() over the chunks
    decode_rows: int = 0          # sequences adding one token
    decode_context: int = 0       # positions the decode rows attend to, summed
    steps: int = 1                # batches it sums (a timed window can cover several: step_sampler.py)

    @classmethod
    def of_batch(cls, items) -> "StepShape":
        """The shape of a scheduled batch (shared/engine/batch.py ScheduledReq items): a row
        past its prompt is a decode row, the rest are prefill chunks (a recomputed output
        position counts as prefill, as the engine's token counters count it)."""
        tokens, pairs, rows, context = 0, 0.0, 0, 0
        for it in items:
            if it.start >= it.req.num_prompt and it.length == 1:
                rows += 1
                context += it.start + 1
            else:
                tokens += it.length
                pairs += attended_pairs(it.start, it.length)
        return cls(tokens, pairs, rows, context)

    @property
    def phase(self) -> str:
        """prefill, decode or mixed (a label of duet_engine_step_seconds)."""
        if self.decode_rows and self.prefill_tokens:
            return "mixed"
        return "decode" if self.decode_rows else "prefill"

    def __add__(self, other: "StepShape") -> "StepShape":
        """Two batches timed as one window: every feature, the fixed cost included, adds up."""
        return StepShape(self.prefill_tokens + other.prefill_tokens, self.attended_pairs + other.attended_pairs,
                         self.decode_rows + other.decode_rows, self.decode_context + other.decode_context,
                         self.steps + other.steps)

    def features(self) -> tuple[float, ...]:
        return (float(self.steps), self.prefill_tokens / _TOKENS, self.attended_pairs / _PAIRS, float(self.decode_rows),
                self.decode_context / _CONTEXT)


@dataclass(frozen=True)
class StepModel:
    """Fitted coefficients, one per feature unit of StepShape.features()."""

    coef: tuple[float, ...]
    samples: int = 0       # timed steps behind the fit (decayed weight aside)
    rel_error: float = 0.0  # root mean square of (measured - predicted) / measured over the fit

    def step_s(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coef, shape.features()))

    def chunk_s(self, start: int, length: int) -> float:
        """What a prefill chunk adds to a step (no base: the step pays that anyway)."""
        return self.coef[1] * length / _TOKENS + self.coef[2] * attended_pairs(start, length) / _PAIRS

    def largest_chunk(self, seconds: float, start: int) -> int:
        """The longest prefill chunk after `start` held tokens that adds at most `seconds`
        (a huge number when prefill costs nothing by this model)."""
        if seconds <= 0:
            return 0
        lin = self.coef[1] / _TOKENS + self.coef[2] * (start + 0.5) / _PAIRS
        quad = self.coef[2] / (2 * _PAIRS)
        if quad <= 0:
            return int(seconds / lin) if lin > 0 else 1 << 30
        return int((-lin + math.sqrt(lin * lin + 4 * quad * seconds)) / (2 * quad))

    # -- registry encoding: named coefficients in natural units (seconds per token, ...) --
    def to_dict(self) -> dict:
        out = {term: c / unit for term, c, unit in zip(TERMS, self.coef, _UNIT)}
        out.update(samples=self.samples, rel_error=round(self.rel_error, 4))
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "StepModel":
        return cls(tuple(float(d[term]) * unit for term, unit in zip(TERMS, _UNIT)),
                   int(d.get("samples", 0)), float(d.get("rel_error", 0.0)))
