"""Runs the engine on one thread and lets asyncio handlers talk to it.

The engine is single-threaded by design. gRPC handlers (asyncio) submit closures that run
on the loop thread between steps, and register a sink per request that receives its
StepOutputs (delivered into the handler's event loop). Roles add `tick` hooks that run
every iteration (pushing KV writes, reading completion notices)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

from shared.engine.outputs import StepOutput

log = logging.getLogger("duet.worker.loop")


class EngineLoop:
    def __init__(self, engine, idle_wait_s: float = 0.02):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        # rid -> (its handler's event loop, its queue); a step's outputs reach each event
        # loop in one call (one wake-up per loop per step, not one per request)
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ticks: list[Callable[[], bool]] = [self._idle_tiers]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.on_step: list[Callable[[list[StepOutput]], None]] = []
        # (start, end) perf_counter stamps of every engine.step() call: the step-time model's input
        self.step_timers: list[Callable[[float, float], None]] = []
        # run after every iteration (a step, a command, a tick or an idle wake-up): load
        # gauges read here are current as of the last change, not of the last timer tick
        self.after_iteration: list[Callable[[], None]] = []
        self.fatal: BaseException | None = None
        # perf_counter when the running iteration began (after its wait for commands), None between
        # iterations: what the step watchdog (step_watchdog.py) bounds
        self.iteration_began: float | None = None

    # -- thread-safe API ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(None)
        self._thread.join(timeout)

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run fn() on the loop thread; the future holds its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        return fut

    async def acall(self, fn: Callable[[], object]):
        return await asyncio.wrap_future(self.call(fn))

    async def acall_or_undo(self, fn: Callable[[], object], undo: Callable[[], object]):
        """acall(fn) for a command that starts something (a request, a waiter) which only the
        awaiting handler would later end. Cancelled (the caller left): fn is withdrawn if the
        loop thread has not taken it, and undo() is queued either way, behind fn if fn was
        taken (the one queue keeps that order). undo must be harmless whether fn ran, raised or
        never ran (it may also free what waited on the caller, e.g. a reservation)."""
        fut = self.call(fn)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()  # not taken yet: it never runs
            self.call(undo)
            raise

    def add_tick(self, fn: Callable[[], bool]) -> None:
        """fn() runs every iteration on the loop thread; it returns True while it has
        something pending (so the loop keeps polling instead of sleeping)."""
        self._ticks.append(fn)

    def _idle_tiers(self) -> bool:
        """An idle engine still moves its host-tier copies on (each step does it otherwise): write-back
        done between requests leaves the next burst pages it can evict at once."""
        return not self.engine.has_work and self.engine.kv.tick_tiers()

    def attach(self, rid: str, aloop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> None:
        """Deliver rid's outputs into q (on aloop). Call on the loop thread (inside call())."""
        self._sinks[rid] = (aloop, q)

    def _deliver(self, outs: list[StepOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            sink = self._sinks.get(out.rid)
            if sink is not None:
                by_loop.setdefault(sink[0], []).append((sink[1], out))
            if out.request_finished and not out.prefill_done:
                self._sinks.pop(out.rid, None)
        for aloop, items in by_loop.items():
            try:
                aloop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that handler's event loop is closed: nobody will read these
                self._orphaned({out.rid for _, out in items})

    def _orphaned(self, rids: set[str]) -> None:
        """End requests whose outputs can no longer be delivered (free their pages) instead of
        letting the error stop the loop for every other request."""
        for rid in rids:
            self._sinks.pop(rid, None)
            self.engine.abort(rid)
        log.warning("dropped %d request(s) whose handler's event loop is closed", len(rids))

    def detach(self, rid: str) -> None:
        self._sinks.pop(rid, None)

    def hand_over(self, count: int) -> int:
        """On the loop thread (inside call()): end up to `count` decoding streams as "moved"
        (Engine.hand_over) and send each its last output, so its handler tells its caller."""
        outs = self.engine.hand_over(count)
        self._deliver(outs)
        return len(outs)

    # -- the loop -----------------------------------------------------------------------
    def _drain(self, block: bool, timeout: float) -> None:
        try:
            item = self._cmds.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # delivered to the caller
                    fut.set_exception(exc)
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        engine = self.engine
        busy = False
        try:
            while not self._stop.is_set():
                self.iteration_began = None
                self._drain(block=not (engine.has_work or busy), timeout=self.idle_wait_s)
                self.iteration_began = time.perf_counter()
                if engine.has_work:
                    t0 = time.perf_counter()
                    outs = engine.step()
                    t1 = time.perf_counter()
                    for timer in self.step_timers:
                        timer(t0, t1)
                    self._deliver(outs)
                    for hook in self.on_step:
                        hook(outs)
                busy = False
                for tick in self._ticks:
                    busy = bool(tick()) or busy
                for hook in self.after_iteration:
                    hook()
                if busy and not engine.has_work:
                    time.sleep(0.0005)  # transfers in flight: poll often, but yield the core
        except BaseException as exc:  # a dead engine thread must not leave handlers hanging
            log.exception("engine loop crashed")
            self.fatal = exc
            self._deliver([StepOutput(rid, [], finished=True, finish_reason="error", error=f"engine failed: {exc}",
                                      request_finished=True) for rid in list(self._sinks)])
            self._sinks.clear()


def _put_all(items) -> None:
    for q, out in items:
        q.put_nowait(out)
