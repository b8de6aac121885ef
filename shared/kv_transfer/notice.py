"""The completion notice a prefill rank sends to the decode rank after its writes land.

It travels as a NIXL notification (sent only after every write of the reservation
completed remotely), so decode learns: "reservation R, generation G is fully written
by rank r; the first token is T". `abort` notices tell decode the writer gave up;
`declined` ones that it wrote nothing on purpose (the reservation's held prefix is not its
prompt's) but its answer stands, so the Generate that follows recomputes the prompt.

The other way, decode sends the writer a `revoke` when a reservation's lease lapsed (its
holder stopped renewing it): the writer stops (an abort notice once its writes in flight
settled) and refuses the capability from then on. A writer that holds no transfer for it
answers at once with an abort echoing the revoke's `ack` token: it may not know the
capability's secret (no Prefill call reached it), so decode takes that echo instead of a MAC.

Every notice carries a MAC keyed by the reservation's capability secret (capability.py):
`key` is that secret on the sending side (never sent), `mac` what arrives, and decode takes a
notice only when `signed_by(the reservation's secret)`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field, fields

MAGIC = b"duet1:"
COMPLETIONS = ("done", "declined", "abort")  # prefill -> decode: how a reservation's writing ended
REVOCATIONS = ("revoke",)  # decode -> prefill: stop writing this reservation
KINDS = COMPLETIONS + REVOCATIONS
MAC_BYTES = 16
_TYPES = {"int": int, "str": str}  # what each field sent must be (the annotations, as strings)


@dataclass(frozen=True)
class TransferNotice:
    reservation_id: int
    generation: int
    rank: int
    request_id: str = ""
    kind: str = "done"          # "done" | "declined" | "abort" | "revoke"
    first_token_id: int = -1    # the token prefill sampled (decode's next input)
    num_tokens: int = 0         # prompt tokens whose KV was written
    kv_bytes: int = 0           # bytes this rank wrote for the reservation
    num_ranks: int = 0          # the writer's TP ranks, each sending a notice (0: the reader's own)
    reply_to: str = ""          # a revoke: the decode worker that sends it (where the answer goes)
    reply_nonce: str = ""       # ... and its instance nonce (reservation ids start over on a restart)
    ack: str = ""               # a revoke: a token its answering abort echoes; that abort: the echo
    mac: str = ""               # hex HMAC-SHA256 (truncated) of the fields above, by the capability secret
    key: bytes = field(default=b"", repr=False, compare=False)  # the secret the sender signs with (not sent)

    def _signed(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("mac", "key")}

    def _body(self) -> bytes:
        return json.dumps(self._signed(), separators=(",", ":")).encode()

    def _mac(self, secret: bytes) -> str:
        return hmac.new(secret, self._body(), hashlib.sha256).digest()[:MAC_BYTES].hex()

    def signed_by(self, secret: bytes) -> bool:
        return bool(secret) and hmac.compare_digest(self.mac, self._mac(secret))

    def encode(self) -> bytes:
        body = self._signed()
        body["mac"] = self._mac(self.key) if self.key else ""
        return MAGIC + json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "TransferNotice | None":
        """None for messages that are not Duet notices (or are malformed)."""
        if not raw.startswith(MAGIC):
            return None
        try:
            values = json.loads(raw[len(MAGIC):])
            values.pop("key", None)
            notice = cls(**values)
        except (ValueError, TypeError, AttributeError):
            return None
        for f in fields(notice):  # wrong types are refused here, never met by the reader
            value = getattr(notice, f.name)
            if f.name != "key" and (not isinstance(value, _TYPES[f.type]) or isinstance(value, bool)):
                return None
        if notice.kind not in KINDS:
            return None
        return notice
