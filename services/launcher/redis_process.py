"""A private redis-server for `duet up` (loopback, no persistence)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

INSTALL_HINT = ("no redis-server found on PATH. Install one (Debian/Ubuntu: `sudo apt-get install "
                "redis-server`; macOS: `brew install redis`) or point Duet at an existing Redis with "
                "--redis-url redis://HOST:PORT/0")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_redis(workdir: Path, log_path: Path, host: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError(INSTALL_HINT)
    port = free_port(host)
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--protected-mode", "yes"],
        stdout=log_path.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode}; see {log_path}")
        try:
            with socket.create_connection((host, port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://{host}:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not answer on {host}:{port}; see {log_path}")
