"""A probe: a bounded attack function plus the verdict the checklist expects of the server."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from loadtest.hostile.context import ProbeContext
from loadtest.hostile.result import ProbeResult

# judge(result) -> (ok, why); ok None: the probe could not tell (e.g. a reading was missing)
Judge = Callable[[ProbeResult], tuple[bool | None, str]]


@dataclass
class Probe:
    name: str
    item: str    # its checklist item (loadtest/hostile/README.md; "extra": a related probe)
    expect: str  # in words, for the table
    run: Callable[[ProbeContext, ProbeResult], Awaitable[None]]  # sends the attack, fills the result
    judge: Judge
    timeout_s: float | None = None  # None: the suite's probe_timeout_s

    def matches(self, selector: str) -> bool:
        return selector in (self.name, self.item) or (selector.endswith("*") and self.name.startswith(selector[:-1]))
