"""A lifecycle as a table of legal moves: (state, event) -> next state.

Each move names the failure rule it serves (its short name in docs/ARCHITECTURE.md, "Failure
rules and the tests that prove them") and the tests that hold it (pytest node ids), so a
reader can go from a transition to its reason and its proof; tests/repo/test_state_tables.py
checks that every name and test exists. A move the table does not hold is a bug in the
caller, not an input to tolerate: `next` logs it and raises IllegalMove. Callers that act on
input from outside (an RPC, a network notice) ask `allows` first and refuse politely."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger("duet.lifecycle")


class IllegalMove(RuntimeError):
    """A transition the lifecycle forbids: an invariant of the caller is broken."""


@dataclass(frozen=True)
class Move:
    src: Enum
    event: Enum
    dst: Enum
    rule: str  # the failure rule it serves: a short name from the rules table
    tests: tuple[str, ...]  # pytest node ids (file::function) of the tests that hold it


class StateTable:
    def __init__(self, name: str, initial: Enum, moves: Iterable[Move]):
        self.name = name
        self.initial = initial
        self.moves: dict[tuple[Enum, Enum], Move] = {}
        for m in moves:
            if (m.src, m.event) in self.moves:
                raise ValueError(f"{name}: two moves from {m.src.name} on {m.event.name}")
            self.moves[(m.src, m.event)] = m

    def allows(self, state: Enum, event: Enum) -> bool:
        return (state, event) in self.moves

    def next(self, state: Enum, event: Enum, subject: str) -> Enum:
        """The state after `event` in `state`; raises IllegalMove (logged) if the table has no such move."""
        move = self.moves.get((state, event))
        if move is None:
            log.error("%s: illegal move: %s on %s (the %s lifecycle has no such transition)",
                      subject, event.name, state.name, self.name)
            raise IllegalMove(f"{subject}: {event.name} is not a legal move from {state.name}")
        return move.dst

    @property
    def terminal(self) -> set[Enum]:
        """States no move leaves."""
        return {m.dst for m in self.moves.values()} - {m.src for m in self.moves.values()}
