"""The child processes of `duet up`: started by exec (never fork: gRPC and torch), in our
process group, each with its log file and its share of the CPU threads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    critical: bool  # the stack cannot serve without it (gateway, router, redis)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    reported: bool = False

    def start(self) -> None:
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(self.argv, stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def duet_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def thread_env(threads: int) -> dict[str, str]:
    """Pin each process's intra-op threads; passive waits so co-located processes do not
    burn each other's cores spinning."""
    t = str(threads)
    return {"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t,
            "OMP_WAIT_POLICY": "PASSIVE", "DUET_THREADS": t, "TOKENIZERS_PARALLELISM": "false"}
