"""A progress bar on stderr while requests run."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from tqdm import tqdm


@dataclass
class Progress:
    total: int | None
    desc: str
    enabled: bool = True
    ok: int = 0
    failed: int = 0
    in_flight: int = 0
    _bar: tqdm | None = field(default=None, repr=False)

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._bar = tqdm(total=self.total, desc=self.desc, unit="req", file=sys.stderr, dynamic_ncols=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()

    def started(self) -> None:
        self.in_flight += 1
        self._show()

    def finished(self, ok: bool) -> None:
        self.in_flight -= 1
        self.ok, self.failed = self.ok + ok, self.failed + (not ok)
        if self._bar is not None:
            self._bar.update(1)
        self._show()

    def _show(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix(ok=self.ok, err=self.failed, in_flight=self.in_flight, refresh=False)
