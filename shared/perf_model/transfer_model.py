"""How long a KV handoff adds to a remote prefill: latency + bytes / bandwidth.

A prefill worker writes each finished page while later chunks compute, so what a request
waits for after its last chunk is the last chunk's pages and the completion notice: the
handoff tail (duet_kv_handoff_tail_seconds). The prefill worker fits this model to its own
tails (services/worker_runtime/perf_tracker.py); the router charges a remote prefill
`seconds(bytes of the last chunk's KV)`."""
from __future__ import annotations

from dataclasses import dataclass

# before any handoff is measured: a conservative guess (a few ms, a TCP-like link); the
# first measured handoffs replace it
DEFAULT_LATENCY_S = 0.002
DEFAULT_BYTES_PER_S = 2e9


@dataclass(frozen=True)
class TransferModel:
    latency_s: float = DEFAULT_LATENCY_S
    bytes_per_s: float = DEFAULT_BYTES_PER_S
    samples: int = 0

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + (num_bytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0)

    # linear_fit coordinates: seconds = c0 * 1 + c1 * (bytes / 1 GB)
    def coef(self) -> tuple[float, float]:
        return self.latency_s, 1e9 / self.bytes_per_s if self.bytes_per_s > 0 else 0.0

    @classmethod
    def from_coef(cls, coef, samples: int) -> "TransferModel":
        return cls(coef[0], 1e9 / coef[1] if coef[1] > 0 else float("inf"), samples)

    def to_dict(self) -> dict:
        return {"latency_s": self.latency_s, "bytes_per_s": self.bytes_per_s, "samples": self.samples}

    @classmethod
    def from_dict(cls, d: dict) -> "TransferModel":
        return cls(float(d["latency_s"]), float(d["bytes_per_s"]), int(d.get("samples", 0)))
