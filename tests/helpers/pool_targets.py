"""Functions a ProcessPool helper runs in tests/gateway/test_process_pool.py (importable by name)."""
from __future__ import annotations

import os
import time


def setup(tag: str) -> dict:
    return {"tag": tag, "calls": 0, "setup_pid": os.getpid()}


def origin(state: dict) -> tuple[int, int]:
    """(the process that ran the setup, this helper's)."""
    return state["setup_pid"], os.getpid()


def echo(state: dict, value):
    state["calls"] += 1
    return state["tag"], value, state["calls"], os.getpid()


def sleep(state: dict, seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def spin(state: dict, seconds: float) -> int:
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


def fail(state: dict, message: str):
    raise ValueError(message)


def noisy(state: dict) -> str:
    print("a library printing to stdout")  # must not corrupt the reply
    return "still fine"


def die(state: dict) -> None:
    os._exit(3)


def bad_setup() -> None:
    raise ImportError("no such thing")


def setup_once_exists(path: str) -> dict:
    """Fails until `path` exists (a start that fails, then one that does not)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is not there yet")
    return {"tag": "late", "calls": 0}
