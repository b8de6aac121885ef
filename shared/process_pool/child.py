"""A pool's helper: reads (kind, "module:function", args) frames, answers each. "setup" runs
once and its return value is the helper's state; every "call" gets that state as its first
argument. What the function raises goes back to the caller. A pool's helpers are forked from
its zygote (zygote.py), which ran the setup, and serve here."""
from __future__ import annotations

import importlib
import os
import pickle
import sys
import threading
import time
from typing import Any

from shared.process_pool.frames import read_frame, write_frame


def resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def answer(kind: str, target: str, args: tuple, state: Any) -> tuple[tuple, Any]:
    """(reply frame, the state afterwards)."""
    try:
        fn = resolve(target)
        if kind == "setup":
            return ("ok", None), fn(*args)
        return ("ok", fn(state, *args)), state
    except Exception as exc:  # the caller's to judge; the helper keeps serving
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return ("raise", exc), state


def exit_with_parent(parent_pid: int, every_s: float = 1.0) -> None:
    """A parent killed mid-call leaves no one to close our stdin: stop when it is gone."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve(requests, replies, state: Any) -> int:
    """Answer frames from `requests` on `replies` until the parent closes `requests`."""
    while True:
        try:
            kind, target, args = read_frame(requests)
        except EOFError:  # the parent closed our stdin (or died): done
            return 0
        reply, state = answer(kind, target, args, state)
        write_frame(replies, reply)


def quiet_stdout():
    """(the real stdout for replies, now a dup): a library's print() must not corrupt the
    frames, so what it prints goes to stderr."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return replies
