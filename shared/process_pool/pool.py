"""A few helper processes (child.py) and a hard time budget on each call.

A zygote process (zygote.py) runs a setup function once (its state: a tokenizer, a grammar
vocabulary); each helper is forked from it with that state and answers calls one at a time.
A call that outlives its budget kills its helper (SIGKILL: a thread cannot be stopped, and
C++ code may hold the GIL) and raises CallTimeout; its replacement is forked at once (a few
milliseconds, not a new interpreter's imports and setup). Helpers start on first use (or
prestart()), outside any call's budget.

Calls run on a thread pool with one thread per helper, so from asyncio they never block the
event loop, and calls beyond the helpers' number wait their turn in order."""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from shared.process_pool.frames import FrameTimeout, encode, read_frame_before

log = logging.getLogger("duet.process_pool")

REPO = Path(__file__).resolve().parents[2]
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
             "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


class CallTimeout(TimeoutError):
    """The call ran past its budget; its helper was killed."""


class CallFailed(RuntimeError):
    """The helper could not start (during_setup) or died during the call (not the function's
    own error, which the call raises as it is)."""

    def __init__(self, message: str, during_setup: bool = False):
        super().__init__(message)
        self.during_setup = during_setup


@dataclass
class PoolStats:
    started: int = 0   # helpers started (forked from the zygote)
    setups: int = 0    # zygotes started: the setup's runs
    timeouts: int = 0  # calls killed at their budget


def _gone(pid: int) -> bool:
    """The process exited. The zygote reaps its helpers (SIGCHLD ignored), so a dead one's pid is
    gone at once; one outliving its zygote is reaped by whoever adopted it (a zombie until then)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


class _Helper:
    """A helper forked by the pool's zygote: its pid and the pool's ends of its two pipes."""

    def __init__(self, name: str, pid: int, requests: BinaryIO, replies: BinaryIO, generation: int = 0):
        self.name = name
        self.pid = pid
        self.requests, self.replies = requests, replies
        self.generation = generation  # the pool's stop() count when it started
        self._dead = False

    @property
    def alive(self) -> bool:
        self._dead = self._dead or _gone(self.pid)
        return not self._dead

    def exchange(self, message: tuple, timeout_s: float) -> Any:
        """Send one request, return the function's result or raise what it raised."""
        deadline = time.monotonic() + timeout_s
        try:
            self.requests.write(encode(message))
            self.requests.flush()
            status, value = read_frame_before(self.replies.fileno(), deadline)
        except FrameTimeout:
            self.kill()
            raise CallTimeout(f"{self.name}: no answer within {timeout_s:g}s") from None
        except (OSError, EOFError, ValueError) as exc:
            self.kill()
            raise CallFailed(f"{self.name} helper process failed: {exc}") from None
        if status == "raise":
            raise value
        return value

    def kill(self, wait_s: float = 5.0) -> None:
        """SIGKILL, then wait (up to wait_s) until it is gone, as a child's wait() would."""
        if not self._dead:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + wait_s
            while not _gone(self.pid) and time.monotonic() < deadline:
                time.sleep(0.005)
            self._dead = True
        for pipe in (self.requests, self.replies):
            try:
                pipe.close()
            except OSError:
                pass


class _Zygote:
    """The process the pool's helpers are forked from (zygote.py): it ran the setup once."""

    def __init__(self, name: str, setup: str, args: tuple, generation: int, timeout_s: float):
        self.name, self.generation = name, generation
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, **CHILD_ENV,
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shared.process_pool.zygote", str(os.getpid()), str(theirs.fileno())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.sock = ours
        self._lock = threading.Lock()  # one fork at a time: its reply and its descriptors go together
        self._ask(("setup", setup, tuple(args)), timeout_s)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _ask(self, message: tuple, timeout_s: float) -> Any:
        try:
            self.proc.stdin.write(encode(message))
            self.proc.stdin.flush()
            status, value = read_frame_before(self.proc.stdout.fileno(), time.monotonic() + timeout_s)
        except (FrameTimeout, OSError, EOFError, ValueError) as exc:
            self.kill()
            raise CallFailed(f"{self.name}: the helpers' zygote failed: {type(exc).__name__}: {exc}") from None
        if status == "raise":
            self.kill()
            raise value
        return value

    def fork(self, timeout_s: float) -> _Helper:
        with self._lock:
            pid = self._ask(("fork", None, ()), timeout_s)
            _, fds, _, _ = socket.recv_fds(self.sock, 16, 2)
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise CallFailed(f"{self.name}: the zygote sent {len(fds)} descriptors for a helper")
        return _Helper(self.name, pid, os.fdopen(fds[0], "wb"), os.fdopen(fds[1], "rb"), self.generation)

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.sock):
            try:
                f.close()
            except OSError:
                pass


class ProcessPool:
    def __init__(self, name: str, setup: str, setup_args: tuple | Callable[[], tuple] = (), processes: int = 1,
                 start_timeout_s: float = 300.0):
        """setup: "module:function" run once in each helper (its return value is the state every
        call gets first); setup_args: its arguments, or a function giving them (evaluated when a
        helper starts, on a pool thread)."""
        if processes < 1:
            raise ValueError(f"{name}: a pool needs at least one process, got {processes}")
        self.name = name
        self.setup = setup
        self.setup_args = setup_args
        self.processes = processes
        self.start_timeout_s = start_timeout_s
        self.stats = PoolStats()
        self._executor = ThreadPoolExecutor(max_workers=processes, thread_name_prefix=f"{name}-pool")
        self._slots: queue.SimpleQueue[_Helper | None] = queue.SimpleQueue()
        for _ in range(processes):
            self._slots.put(None)
        self._closed = False
        self._generation = 0  # bumped by stop(): older helpers are killed when they come back
        self._ever_started = False
        self._starting = 0  # helpers starting now
        self.start_error: str | None = None  # why the last start failed (None after a success)
        self._zygote_proc: _Zygote | None = None
        self._zygote_lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """A helper has started (and set up) at least once: calls no longer wait for the first
        one's interpreter and imports (a readiness check can wait for this after prestart())."""
        return self._ever_started

    def ensure_starting(self) -> None:
        """Not ready and no helper starting (the first start failed): try again, in the
        background (a readiness check calls this, so a transient failure does not stick)."""
        if not self._ever_started and not self._starting and not self._closed:
            self.prestart(1)

    async def call(self, target: str, *args: Any, timeout_s: float) -> Any:
        """target(state, *args) in a helper; CallTimeout past timeout_s (the wait for a free
        helper and its start do not count)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._run, target, args, timeout_s)

    def call_sync(self, target: str, *args: Any, timeout_s: float) -> Any:
        return self._executor.submit(self._run, target, args, timeout_s).result()

    def prestart(self, count: int | None = None) -> None:
        """Start `count` helpers (default: all) now, in the background."""
        for _ in range(min(count or self.processes, self.processes)):
            self._executor.submit(self._warm)

    def stop(self) -> None:
        """Kill the helpers (a busy one when its call returns); the pool stays usable: the next
        call starts a fresh helper."""
        self._generation += 1
        idle = []
        while True:
            try:
                idle.append(self._slots.get_nowait())
            except queue.Empty:
                break
        for helper in idle:
            if helper is not None:
                helper.kill()
            self._slots.put(None)
        with self._zygote_lock:  # the next helper comes from a fresh setup
            if self._zygote_proc is not None:
                self._zygote_proc.kill()
                self._zygote_proc = None

    def close(self) -> None:
        """stop(), and no calls any more."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.stop()

    # -- on a pool thread ----------------------------------------------------------------
    def _run(self, target: str, args: tuple, timeout_s: float) -> Any:
        helper = self._slots.get()  # never waits: one thread per slot
        if helper is None or not helper.alive:
            helper = self._started_instead(helper)
        try:
            if helper is None or not helper.alive:
                helper = self._start()
            try:
                return helper.exchange(("call", target, args), timeout_s)
            except CallTimeout:
                self.stats.timeouts += 1
                log.warning("%s: a call to %s ran past %gs; its helper process was killed", self.name, target,
                            timeout_s)
                if not self._closed:
                    self._executor.submit(self._warm)  # its replacement starts now, not on the next call
                raise
        finally:
            self._slots.put(self._current(helper))

    def _started_instead(self, first: _Helper | None) -> _Helper | None:
        """A started helper from the idle slots in place of `first` (an unstarted or dead slot,
        which goes back), else `first`. The slots are first in, first out: after prestart(1) a
        pool of two hands out the unstarted slot first, and the call would wait for a helper to
        start (the interpreter, the imports, the setup: ~0.9 s for the gateway's chat templates)
        while a started one sat idle."""
        idle, found = [], None
        for _ in range(self.processes - 1):
            try:
                slot = self._slots.get_nowait()
            except queue.Empty:
                break
            if found is None and slot is not None and slot.alive:
                found = slot
            else:
                idle.append(slot)
        for slot in idle:
            self._slots.put(slot)
        if found is None:
            return first
        self._slots.put(first)
        return found

    def _current(self, helper: _Helper | None) -> _Helper | None:
        """helper, or None (killed) when it is older than the last stop()."""
        if helper is not None and (self._closed or helper.generation != self._generation):
            helper.kill()
            return None
        return helper

    def _warm(self) -> None:
        helper = self._slots.get()
        try:
            if helper is None or not helper.alive:
                helper = self._start()
        except Exception as exc:
            log.warning("%s: could not start a helper process: %s", self.name, exc)
        finally:
            self._slots.put(self._current(helper))

    def _start(self) -> _Helper:
        if self._closed:
            raise CallFailed(f"{self.name}: the pool is closed", during_setup=True)
        self._starting += 1
        try:
            helper = self._zygote().fork(self.start_timeout_s)
            self.stats.started += 1
        except Exception as exc:
            self.start_error = f"{type(exc).__name__}: {exc}"
            raise CallFailed(f"{self.name}: a helper process could not start: {self.start_error}",
                             during_setup=True) from None
        finally:
            self._starting -= 1
        self._ever_started, self.start_error = True, None
        return helper

    def _zygote(self) -> _Zygote:
        """The live zygote of this generation, started (and set up) if there is none."""
        with self._zygote_lock:
            z = self._zygote_proc
            if z is None or not z.alive or z.generation != self._generation:
                if z is not None:
                    z.kill()
                self._zygote_proc = None
                args = self.setup_args() if callable(self.setup_args) else self.setup_args
                self._zygote_proc = _Zygote(self.name, self.setup, args, self._generation, self.start_timeout_s)
                self.stats.setups += 1
            return self._zygote_proc
