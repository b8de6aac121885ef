"""The write capability a decode reservation carries, as data (what it grants is checked in
capability.py, which needs the reservation; the reservation's wire form needs only this)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WriteCapability:
    writer_id: str  # the prefill worker that may write (registry id)
    lifetime_ms: int  # how long it may write, from when it receives the reservation
    secret: bytes  # the completion notices' MAC key
    signature: bytes = b""  # Ed25519 over signed_bytes(reservation)
