"""A private redis-server for `duet up` (loopback, no persistence), supervised like any other
child: restarted on the same port (and with the same password), empty; workers re-register at
their next heartbeat and the router and gateway reconnect (shared/registry)."""
from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

from services.launcher.children import Child

INSTALL_HINT = ("no redis-server found on PATH. Install one (Debian/Ubuntu: `sudo apt-get install "
                "redis-server`; macOS: `brew install redis`) or point Duet at an existing Redis with "
                "--redis-url redis://HOST:PORT/0")


def redis_child(workdir: Path, log_path: Path, host: str, port: int, config_file: Path | None = None) -> Child:
    """The redis-server child; config_file (0600) holds what must stay off its command line
    (requirepass)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError(INSTALL_HINT)
    first = [str(config_file)] if config_file is not None else []  # a config file must come first
    return Child("redis", [exe, *first, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
                           "--dir", str(workdir), "--protected-mode", "yes"], log_path, kind="redis")


def wait_ready(child: Child, host: str, port: int, timeout_s: float = 10.0) -> str:
    """Wait until the started child answers; its URL. A password-protected Redis answers an
    unauthenticated PING with NOAUTH, which is answer enough."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.exit_code is not None:
            raise RuntimeError(f"redis-server exited with code {child.exit_code}; see {child.log_path}")
        try:
            with socket.create_connection((host, port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                    return f"redis://{host}:{port}/0"
        except OSError:
            time.sleep(0.05)
    child.kill()
    raise RuntimeError(f"redis-server did not answer on {host}:{port}; see {child.log_path}")
