"""Refusing what the gRPC contract cannot carry, by field: int32 fields, the uint64 seed
(a negative seed down to -2**63 travels as its two's complement, which the engine's
generator reads the same), float fields finite in float32. The ranges themselves are the
contract's (protos/wire_ranges.py), which the gateway's request checks read too."""
from __future__ import annotations

import math

from protos.wire_ranges import FLOAT32_MAX, INT32_MAX, INT32_MIN, SEED_MAX, SEED_MIN


class ContractOverflow(ValueError):
    """A value the gRPC contract cannot carry; `field` names it (OpenAI's name where there is one)."""

    def __init__(self, field: str, value, what: str):
        super().__init__(f"{field} must be {what}, got {value!r}")
        self.field = field


def int32(field: str, value: int) -> int:
    if not INT32_MIN <= value <= INT32_MAX:
        raise ContractOverflow(field, value, f"between {INT32_MIN} and {INT32_MAX}")
    return value


def float32(field: str, value: float) -> float:
    if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise ContractOverflow(field, value, "a finite number (float32)")
    return value


def seed_to_uint64(value: int) -> int:
    if not SEED_MIN <= value <= SEED_MAX:
        raise ContractOverflow("seed", value, f"between {SEED_MIN} and {SEED_MAX}")
    return value % (1 << 64)
