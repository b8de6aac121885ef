"""Probes for tests that kill workers mid-request on a ProcessStack (tests/helpers/stack.py):
a long streamed request in a thread, a prefill worker frozen while it still has KV to write,
the worker holding a request's KV. Used by tests/disagg/test_failures_workers.py (the rules
under the error a client sees) and tests/disagg/test_failover_prefill.py (failover on)."""
from __future__ import annotations

import contextlib
import signal
import threading
import time

from tests.helpers.stack import wait_until

# ~2600 tokens: at 16 tokens a step, prefill takes ~165 steps, time enough to stop it mid-way
# even on a fast machine (frozen_mid_prefill checks that it was)
LONG_PROMPT = " ".join(f"item {i} is a small grey pebble;" for i in range(320))
CHUNK = 16


class Background:
    """One request in a thread: its result or its exception."""

    def __init__(self, fn):
        self.result = self.error = None
        self.first_chunk = threading.Event()  # set by fn when the first token arrives
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except Exception as exc:
            self.error = exc

    def join(self, timeout: float):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request hung"
        return self


def long_request(stack, model, prompt: str = LONG_PROMPT):
    """The prompt, greedy, streamed in a thread (Background): its text in `result`."""
    def run():
        stream = stack.client().completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                                   stream=True)
        text = ""
        for c in stream:
            if c.choices:
                bg.first_chunk.set()
                text += c.choices[0].text
        return text
    bg = Background(run)
    return bg


@contextlib.contextmanager
def frozen_mid_prefill(stack, writer: str, request: Background):
    """SIGSTOP the prefill worker and make sure it had not finished the prompt (its first
    token never reached the client); SIGCONT on exit. What the body does (kill a peer)
    then happens while prefill still has writes to make, however fast the machine is."""
    stack.procs[writer].signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)  # a first token already on its way reaches the client by now
        assert not request.first_chunk.is_set(), "prefill finished the long prompt before it could be stopped"
        yield
    finally:
        stack.procs[writer].signal(signal.SIGCONT)


def holder(stack, worker_ids, what: str, timeout: float = 60) -> str:
    """The worker among worker_ids that holds KV or a running request for the long prompt."""
    def busy():
        for w in worker_ids:
            if stack.kv_usage(w) > 0 or stack.running(w) > 0:
                return w
        return None
    return wait_until(busy, timeout, what, interval=0.05)
