"""Stop strings on streamed text: never emit the stop string, hold back a possible start of one.

Text arrives in pieces, so a stop string may straddle pieces. After each piece we emit
everything except the longest tail that is a prefix of some stop string; that tail
waits until the next piece shows whether a stop string really follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopStringMatcher:
    stops: list[str]
    _held: str = field(default="", init=False)
    stopped: bool = field(default=False, init=False)
    matched: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.stops = [s for s in self.stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)

    @property
    def held(self) -> str:
        return self._held

    def feed(self, text: str) -> str:
        """Add text; return what is safe to emit. After a match, `stopped` is True and
        the returned text ends just before the stop string (everything later is dropped)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        cut = self._earliest_match(buffer)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._partial_tail_len(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """Generation ended without a match: the held tail is ordinary text."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _earliest_match(self, buffer: str) -> int | None:
        best = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at != -1 and (best is None or at < best):
                best = at
                self.matched = stop
        return best

    def _partial_tail_len(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop string."""
        for length in range(min(self._longest - 1, len(buffer)), 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
