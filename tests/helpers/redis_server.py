"""A real redis-server for tests: free port, temp dir, no persistence.

Use as a context manager:

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)

or as a pytest fixture (import it into your test module or conftest):

    from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)

    def test_x(redis_server):
        ... redis_server.url ...

`stop()` then `start()` restarts it on the same port (empty), to test
"Redis briefly down".
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from services.launcher.ports import free_port as launcher_free_port

REDIS_SERVER_BIN = os.environ.get("DUET_TEST_REDIS_SERVER", shutil.which("redis-server") or "/usr/bin/redis-server")


def free_port() -> int:
    """A TCP port free a moment ago on 127.0.0.1, outside the outgoing-connection range."""
    return launcher_free_port("127.0.0.1")


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process bound to 127.0.0.1 on a free port."""

    def __init__(self, port: int | None = None, startup_timeout_s: float = 10.0):
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self._dir: Path | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "RedisServer":
        if self.running:
            return self
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="duet-redis-"))
        self._proc = subprocess.Popen(
            [
                REDIS_SERVER_BIN,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self._dir),
                "--save", "",
                "--appendonly", "no",
                "--protected-mode", "no",
                "--daemonize", "no",
                "--loglevel", "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while not _ping(self.port):
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {err}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop the process (data is lost: no persistence). The temp dir stays for a restart."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if proc.stderr:
            proc.stderr.close()

    def close(self) -> None:
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def redis_server():
    """A fresh redis-server per test; yields the RedisServer (use `.url`)."""
    with RedisServer() as server:
        yield server
