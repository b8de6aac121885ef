"""A write capability writes once: the reservations this prefill worker has taken a Prefill
for, so a second call naming the same one (a replay, or two gateways racing) is refused
before it could write the pages a second time."""
from __future__ import annotations

from collections import OrderedDict

KEPT = 16384  # the latest capabilities taken; far more than a worker holds at once


class CapabilityUses:
    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self._taken: OrderedDict[tuple[str, str, int, int], None] = OrderedDict()

    def take(self, decode_worker_id: str, instance_nonce: str, reservation_id: int, generation: int) -> bool:
        """False when this reservation's capability was taken already."""
        key = (decode_worker_id, instance_nonce, reservation_id, generation)
        if key in self._taken:
            return False
        self._taken[key] = None
        while len(self._taken) > self.kept:
            self._taken.popitem(last=False)
        return True
