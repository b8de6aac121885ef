"""Where a worker's start-up time goes, phase by phase, for one log line when it registers.

The engine records its own phases (CUDA, weights, the KV pool, the host tier, graphs); the
worker adds warm-up, calibration, its role's parts (NIXL agents) and registration, and the
time before any of it (`process`: the interpreter, imports, flags) comes from the kernel's
record of when the process began. What runs on in the background after registration (the
host tier's pinning) reports its own time when done."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field


def process_age_s() -> float | None:
    """Seconds since this process began (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class StartupPhases:
    phases: list[tuple[str, float]] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)  # phase -> what it did, for the log line

    @contextmanager
    def phase(self, name: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t0)

    def add(self, name: str, seconds: float) -> None:
        for i, (have, before) in enumerate(self.phases):
            if have == name:  # a phase entered twice (a rebuilt part) counts once, summed
                self.phases[i] = (name, before + seconds)
                return
        self.phases.append((name, seconds))

    def note(self, name: str, text: str) -> None:
        self.notes[name] = text

    def render(self) -> str:
        """"process 2.1s, cuda 0.8s, weights 10.2s (...), ...; ready 31.0s after the process began"."""
        parts = [f"{name} {seconds:.1f}s" + (f" ({self.notes[name]})" if name in self.notes else "")
                 for name, seconds in self.phases]
        age = process_age_s()
        return ", ".join(parts) + (f"; ready {age:.1f}s after the process began" if age is not None else "")
