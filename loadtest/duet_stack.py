"""Start and stop a local `duet up` stack from Python (for stack-vs-stack comparisons)."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from services.launcher.ports import free_port

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclass
class DuetStack:
    """One `duet up` process (it owns redis, router, workers, gateway) in its own process group."""

    up_args: list[str]
    log_dir: pathlib.Path
    port: int = 0
    proc: subprocess.Popen | None = None
    env: dict[str, str] | None = None  # more environment for `duet up` and its children

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, health_timeout_s: float = 600.0) -> "DuetStack":
        self.port = self.port or free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, **(self.env or {}), "PYTHONPATH": path}
        with open(self.log_dir / "up.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "up", "--port", str(self.port), "--log-dir", str(self.log_dir),
                 *self.up_args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=REPO_ROOT)
        deadline = time.monotonic() + health_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"duet up {' '.join(self.up_args)} exited; see {self.log_dir / 'up.log'}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"duet up {' '.join(self.up_args)} not healthy in {health_timeout_s:.0f}s")
            try:  # the banner: every worker reported ready (the gateway serves on decode workers alone)
                if b"Duet is up." in (self.log_dir / "up.log").read_bytes() and \
                        httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)

    def stop(self, grace_s: float = 90.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # duet up stops its children in order
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group we made for this stack
            self.proc.wait()

    def __enter__(self) -> "DuetStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def live_child(pid: int, marker: str):
    """The live descendant (a psutil.Process) of process `pid` whose command line contains
    `marker` (e.g. `--worker-id decode-0 ` for that worker of a `duet up`)."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        try:
            if marker in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                return child
        except psutil.NoSuchProcess:
            continue
    raise LookupError(f"process {pid} has no live child with {marker!r}")
