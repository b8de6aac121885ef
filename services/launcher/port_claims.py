"""Ports handed out on this machine a moment ago, shared by every process that picks them.

A port picked as free is bound only later, by a child, after its imports (seconds). Two
processes picking at once (two test workers starting stacks, two launchers) could hand out the
same port in that window, and one child then fails to bind (a router once did, and its stack
waited for it in vain). A claim is a file created exclusively in a shared folder; it lapses
after CLAIM_S, by which time the child has bound the port (or will not)."""
from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path

CLAIM_S = 120.0


def claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / "duet-port-claims"


def claim(port: int, folder: Path | None = None, now: float | None = None) -> bool:
    """True when this process may hand out `port`: no other claimed it within CLAIM_S. Where no
    claim can be written (a read-only or foreign folder) every port may be handed out."""
    folder = folder or claims_dir()
    now = time.time() if now is None else now
    path = folder / str(port)
    try:
        folder.mkdir(mode=0o1777, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    except FileExistsError:
        try:
            if now - path.stat().st_mtime < CLAIM_S:
                return False
            os.utime(path, (now, now))  # a lapsed claim: this process's now
        except OSError:
            return False
        return True
    except OSError:
        return True
    os.close(fd)
    os.utime(path, (now, now))  # the claim's time is the caller's clock (a test's, or time.time())
    if random.random() < 1 / 64:  # now and then, forget lapsed claims
        forget_lapsed(folder, now)
    return True


def forget_lapsed(folder: Path, now: float) -> None:
    for entry in folder.iterdir():
        try:
            if now - entry.stat().st_mtime >= CLAIM_S:
                entry.unlink()
        except OSError:
            pass
