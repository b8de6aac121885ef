"""The completion notice a prefill rank sends to the decode rank after its writes land.

It travels as a NIXL notification (sent only after every write of the reservation
completed remotely), so decode learns: "reservation R, generation G is fully written
by rank r; the first token is T". `abort` notices tell decode the writer gave up;
`declined` ones that it wrote nothing on purpose (the reservation's held prefix is not its
prompt's) but its answer stands, so the Generate that follows recomputes the prompt.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

MAGIC = b"duet1:"


@dataclass(frozen=True)
class TransferNotice:
    reservation_id: int
    generation: int
    rank: int
    request_id: str = ""
    kind: str = "done"          # "done" | "declined" | "abort"
    first_token_id: int = -1    # the token prefill sampled (decode's next input)
    num_tokens: int = 0         # prompt tokens whose KV was written
    kv_bytes: int = 0           # bytes this rank wrote for the reservation
    num_ranks: int = 0          # the writer's TP ranks, each sending a notice (0: the reader's own)

    def encode(self) -> bytes:
        return MAGIC + json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "TransferNotice | None":
        """None for messages that are not Duet notices (or are malformed)."""
        if not raw.startswith(MAGIC):
            return None
        try:
            fields = json.loads(raw[len(MAGIC):])
            notice = cls(**fields)
        except (ValueError, TypeError):
            return None
        if notice.kind not in ("done", "declined", "abort"):
            return None
        return notice
