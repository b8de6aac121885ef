"""Exponentially weighted least squares with non-negative coefficients, refitted on demand.

Samples are folded into the normal equations (X'WX, X'Wy) with a forgetting factor, so recent
steps count most and a worker's model follows what it runs now (recursive least squares
with forgetting, folded in batches at each refit instead of per sample). Each sample weighs
1 / y^2: the fit minimises relative error, so short decode steps count as much as long prefill
steps, and one step stalled by a pause (a 100x outlier) moves the fit by at most one sample's
worth. Directions the samples do not cover (a prefill worker never runs decode rows) stay
at the prior, through a small ridge toward it."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_RIDGE = 1e-4       # default pull toward the prior, relative to each term's own weight in the data
_MIN_Y = 1e-6       # seconds: a sample below this is a clock artefact, not a step


class OnlineLinearFit:
    def __init__(self, prior: Sequence[float], half_life: float = 1000.0, ridge: Sequence[float] | None = None):
        """prior: the coefficients where data says nothing (calibration's, or zeros);
        half_life: samples after which a sample's weight has halved; ridge: per term, how
        strongly it is pulled toward the prior, relative to its weight in the data."""
        n = len(prior)
        self.prior = np.asarray(prior, dtype=np.float64)
        self.ridge = np.full(n, _RIDGE) if ridge is None else np.asarray(ridge, dtype=np.float64)
        self.decay = 0.5 ** (1.0 / half_life)
        self.xtx = np.zeros((n, n))
        self.xty = np.zeros(n)
        self.yty = 0.0
        self.weight = 0.0   # decayed sum of sample weights (1 per sample)
        self.count = 0      # samples ever folded in
        self._pending: list[tuple[Sequence[float], float]] = []

    def add(self, x: Sequence[float], y: float) -> None:
        """Queue one sample (cheap: the engine loop calls this every step)."""
        if y >= _MIN_Y:
            self._pending.append((x, y))

    def _fold(self) -> None:
        if not self._pending:
            return
        xs = np.asarray([x for x, _ in self._pending], dtype=np.float64)
        ys = np.asarray([y for _, y in self._pending], dtype=np.float64)
        k = len(ys)
        age = self.decay ** np.arange(k - 1, -1, -1)  # the newest sample weighs 1
        w = age / (ys * ys)
        keep = self.decay ** k
        self.xtx = keep * self.xtx + (xs * w[:, None]).T @ xs
        self.xty = keep * self.xty + xs.T @ (w * ys)
        self.yty = keep * self.yty + float(w @ (ys * ys))
        self.weight = keep * self.weight + float(age.sum())
        self.count += k
        self._pending.clear()

    def solve(self) -> tuple[tuple[float, ...], float]:
        """(coefficients, relative RMS error of the fit). Non-negative: a coefficient the
        unconstrained solution makes negative is held at 0 and the rest refitted (an
        active-set pass; with a handful of terms it settles in a few rounds)."""
        self._fold()
        n = len(self.prior)
        if self.weight <= 0:
            return tuple(float(c) for c in np.maximum(self.prior, 0)), 0.0
        # per-term ridge (scale-free): a term the samples barely move keeps the prior's value
        lam = self.ridge * np.maximum(np.diag(self.xtx), 1e-12 * max(float(np.trace(self.xtx)), 1e-12))
        a = self.xtx + np.diag(lam)
        b = self.xty + lam * np.maximum(self.prior, 0)
        free = np.ones(n, dtype=bool)
        coef = np.zeros(n)
        for _ in range(n + 1):
            coef[:] = 0
            idx = np.flatnonzero(free)
            coef[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            if (coef >= 0).all():
                break
            free &= coef > 0
        coef = np.maximum(coef, 0)
        # sum of w * (y - x.c)^2 / sum of w (w = 1/y^2: squared relative residuals)
        sse = self.yty - 2 * coef @ self.xty + coef @ self.xtx @ coef
        rel = float(np.sqrt(max(sse, 0.0) / self.weight))
        return tuple(float(c) for c in coef), rel
