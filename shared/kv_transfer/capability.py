"""The write capability a decode worker hands out with each reservation: the only thing that
lets a prefill worker write into its pages.

Decode signs, with its instance's Ed25519 key (the public half is in its registry entry,
`capability_key`), exactly what the writer may do: these destination pages on these ranks
of this reservation (id, generation, decode worker and instance), after these held pages,
by this writer (the prefill worker the Reserve named), for this long. A random 128-bit
secret travels beside the signature; the writer MACs every completion notice with it
(notice.py), so decode takes a notice only from whoever holds the capability.

Prefill verifies before it writes anything (`refusal`); a reservation a client made up, one
for another writer, or one whose pages were changed on the way does not verify. Lifetimes
are durations, never clock readings: each side counts from its own monotonic clock (decode
from the grant, prefill from the Prefill call, which is later, so prefill's own deadline
never comes first; decode quarantines what may still be written, docs/ARCHITECTURE.md §4)."""
from __future__ import annotations

import json
import secrets

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.kv_transfer.write_capability import WriteCapability
from shared.wire.reservation import KvReservation

SECRET_BYTES = 16  # 128 bits: the notice MAC's key
DOMAIN = "duet-write-capability/1"  # what the signature is over, so it signs nothing else


def signed_bytes(res: KvReservation, cap: WriteCapability) -> bytes:
    """The canonical bytes a capability's signature covers: every field of the reservation
    that says where or what is written, and the capability's writer and lifetime."""
    ranks = [[r.rank, r.agent_name, [int(p) for p in r.page_ids]] for r in sorted(res.ranks, key=lambda r: r.rank)]
    body = [DOMAIN, res.reservation_id, res.generation, res.decode_worker_id, res.decode_instance_nonce,
            res.page_size, res.num_layers, res.kv_dtype, res.compat_hash, res.held_pages,
            [int(h) for h in res.held_page_hashes], ranks, cap.writer_id, cap.lifetime_ms]
    return json.dumps(body, separators=(",", ":")).encode()


class CapabilityIssuer:
    """A decode worker instance's signing key (made at start, never stored)."""

    def __init__(self, key: Ed25519PrivateKey | None = None):
        self._key = key or Ed25519PrivateKey.generate()
        self.public_key = self._key.public_key().public_bytes_raw().hex()  # published in the registry

    def issue(self, res: KvReservation, writer_id: str, lifetime_ms: int, secret: bytes) -> WriteCapability:
        unsigned = WriteCapability(writer_id, lifetime_ms, secret)
        return WriteCapability(writer_id, lifetime_ms, secret, self._key.sign(signed_bytes(res, unsigned)))


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def refusal(res: KvReservation, writer_id: str, public_key: str) -> tuple[str, str]:
    """Why `writer_id` may not write into res's pages, as (a short reason, the message);
    ("", "") when it may. public_key: the decode worker's `capability_key` from its registry
    entry (the instance res names)."""
    cap = res.capability
    if cap is None or not cap.signature:
        return "missing", "the reservation carries no write capability"
    if cap.writer_id != writer_id:
        return "writer", f"the write capability is for writer {cap.writer_id!r}, not {writer_id!r}"
    if len(cap.secret) != SECRET_BYTES or cap.lifetime_ms <= 0:
        return "malformed", "the write capability is malformed"
    if not public_key:
        return "malformed", f"decode worker {res.decode_worker_id} publishes no capability key"
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key)).verify(cap.signature, signed_bytes(res, cap))
    except (InvalidSignature, ValueError):
        return "signature", "the write capability's signature does not verify (forged, or its pages were changed)"
    return "", ""
