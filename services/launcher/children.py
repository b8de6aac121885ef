"""The child processes of `duet up`: started by exec (never fork: gRPC and torch), in our
process group, each with its log file (appended to across restarts) and its share of the
CPU threads. A child is started again with the same command line: same ports, same worker id."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    kind: str  # "worker", "gateway", "router", "planner" or "redis": the drain order (shutdown.py)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0  # time.monotonic() of the last start
    starts: int = 0
    log_offset: int = 0  # the log's size at the last start: what this start wrote follows it
    _found: set[str] = field(default_factory=set)  # texts this start wrote (wrote_since_start)

    def start(self) -> None:
        env = {**os.environ, **self.env}
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            self.log_offset = log.tell()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
        self.started_at = time.monotonic()
        self.starts += 1
        self._found = set()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.running:
            self.proc.kill()
            self.proc.wait()

    def wrote_since_start(self, text: str) -> bool:
        """Whether this start of the child wrote `text` to its log (e.g. a worker's ready line)."""
        if text in self._found:
            return True
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_offset)
                if text.encode() in log.read():
                    self._found.add(text)
                    return True
        except OSError:
            pass
        return False

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def describe_exit(code: int) -> str:
    """'code 2', or 'code -9 (SIGKILL)' for a child killed by a signal."""
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


def duet_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def thread_env(threads: int) -> dict[str, str]:
    """Pin each process's intra-op threads; passive waits so co-located processes do not
    burn each other's cores spinning."""
    t = str(threads)
    return {"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t,
            "OMP_WAIT_POLICY": "PASSIVE", "DUET_THREADS": t, "TOKENIZERS_PARALLELISM": "false"}
