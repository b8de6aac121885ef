"""One transfer agent's incoming Duet notices, sorted by the part that reads them: completion
notices (done, declined, abort) for decode's ReservationBook, revocations for prefill's
OutgoingTransfers. A switchable worker runs both on one agent, and NIXL hands every
notification to whoever drains it first, so neither reads the agent directly. Used from the
engine-loop thread only."""
from __future__ import annotations

from collections.abc import Iterable

from shared.kv_transfer.notice import TransferNotice


class NoticeInbox:
    def __init__(self, agent):
        self.agent = agent
        self._waiting: list[TransferNotice] = []

    def take(self, kinds: Iterable[str]) -> list[TransferNotice]:
        """The new notices of these kinds, in arrival order (the others wait for their reader)."""
        kinds = set(kinds)
        self._waiting.extend(self.agent.get_notices())
        mine = [n for n in self._waiting if n.kind in kinds]
        self._waiting = [n for n in self._waiting if n.kind not in kinds]
        return mine

    def view(self, kinds: Iterable[str]) -> "InboxView":
        return InboxView(self, tuple(kinds))


class InboxView:
    """What one reader sees: `get_notices()` as on an agent, of its kinds only."""

    def __init__(self, inbox: NoticeInbox, kinds: tuple[str, ...]):
        self.inbox = inbox
        self.kinds = kinds

    def get_notices(self) -> list[TransferNotice]:
        return self.inbox.take(self.kinds)
