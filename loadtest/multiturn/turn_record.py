"""What one turn of one conversation did: the request's record plus where it sits."""
from __future__ import annotations

from dataclasses import dataclass

from loadtest.records import RequestRecord


@dataclass
class TurnRecord:
    conversation: int
    turn: int  # 0-based index within its conversation
    request: RequestRecord
    messages: list[dict] | None = None  # the request's messages, kept only with --save-text

    def to_json(self) -> dict:
        d = {"conversation": self.conversation, "turn": self.turn, **self.request.to_json()}
        if self.messages is not None:
            d["messages"] = self.messages
        return d

    @classmethod
    def from_json(cls, d: dict) -> "TurnRecord":
        return cls(d["conversation"], d["turn"], RequestRecord.from_json(d), d.get("messages"))


@dataclass
class DialogOutcome:
    """How far one conversation got, and why it stopped."""

    conversation: int
    planned_turns: int
    turns_sent: int
    ended: str  # finished | context_limit | error | time_up | interrupted

    def to_json(self) -> dict:
        return dict(self.__dict__)
