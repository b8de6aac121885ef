"""A handler that leaves while its start command waits on the engine thread.

The engine thread runs handlers' commands between steps. A handler cancelled (its client
left) after the thread took its start command used to leave the request running unheard to
its last token, holding its pages: the test of dropped requests once saw the KV still held
20 s later. acall_or_undo queues the undo behind the start instead; a start still queued is
withdrawn and never runs (the undo still runs: it must be harmless then). A handler whose
event loop closed while its request ran (nobody can read it any more) has its request ended,
not the engine thread stopped for everyone."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.worker_runtime.engine_loop import EngineLoop
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import assert_all_pages_free, build_model_dir, random_prompts

KIND = "llama_tied_gqa2"

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("loop_cancel") / KIND, KIND, seed=7)


@pytest.fixture
def running(model_dir):
    engine = Engine(model_dir=str(model_dir), dtype="float32", device="cpu", page_size=4)
    loop = EngineLoop(engine)
    loop.start()
    yield engine, loop
    loop.stop()


def starter(engine, loop, rid, taken: threading.Event, release: threading.Event, aloop, q):
    prompt = random_prompts(1, [40], seed=3)[0]

    def start():
        taken.set()
        release.wait(10)  # the handler is cancelled while this runs
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), rid=rid)
        loop.attach(rid, aloop, q)
    return start


def run_in_loop_thread(loop, fn):
    return loop.call(fn).result(10)


async def a_few_outputs(engine, loop, rid, n, start_with) -> list:
    """rid started through start_with(start) (loop.acall, or an acall_or_undo), its first n
    outputs read, then ended before the calling event loop closes."""
    taken, release = threading.Event(), threading.Event()
    release.set()
    q: asyncio.Queue = asyncio.Queue()
    await start_with(starter(engine, loop, rid, taken, release, asyncio.get_running_loop(), q))
    outs = [await q.get() for _ in range(n)]
    await loop.acall(lambda: (loop.detach(rid), engine.abort(rid)))
    return outs


def test_a_start_taken_before_the_cancel_is_undone(running):
    engine, loop = running
    taken, release = threading.Event(), threading.Event()

    async def handler_leaves():
        q: asyncio.Queue = asyncio.Queue()
        start = starter(engine, loop, "r1", taken, release, asyncio.get_running_loop(), q)
        task = asyncio.ensure_future(loop.acall_or_undo(start, lambda: (loop.detach("r1"), engine.abort("r1"))))
        while not taken.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
    asyncio.run(handler_leaves())
    # the undo ran right behind the start: nothing of r1 is left, however long it asked for
    assert run_in_loop_thread(loop, lambda: "r1" in engine.requests) is False
    run_in_loop_thread(loop, lambda: assert_all_pages_free(engine))


def test_a_start_still_queued_is_withdrawn(running):
    engine, loop = running
    gate, taken, release = threading.Event(), threading.Event(), threading.Event()
    release.set()
    undone = []

    async def handler_leaves():
        q: asyncio.Queue = asyncio.Queue()
        loop.call(lambda: gate.wait(10))  # the engine thread is busy with an earlier command
        start = starter(engine, loop, "r2", taken, release, asyncio.get_running_loop(), q)
        task = asyncio.ensure_future(loop.acall_or_undo(start, lambda: undone.append("r2")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
    asyncio.run(handler_leaves())
    run_in_loop_thread(loop, lambda: None)  # everything queued before this has run
    assert not taken.is_set() and undone == ["r2"]  # never ran; the undo ran anyway (harmless by contract)
    run_in_loop_thread(loop, lambda: assert_all_pages_free(engine))


def test_a_start_that_completes_is_not_undone(running):
    engine, loop = running
    outs = asyncio.run(a_few_outputs(engine, loop, "r3", 3,
                                     lambda start: loop.acall_or_undo(start, lambda: engine.abort("r3"))))
    assert all(o.rid == "r3" and o.token_ids and not o.finished for o in outs)  # it ran on: nothing undid it
    run_in_loop_thread(loop, lambda: assert_all_pages_free(engine))


def test_a_closed_handler_loop_ends_its_request_not_the_engine(running):
    engine, loop = running
    taken, release = threading.Event(), threading.Event()
    release.set()

    async def handler_loop_goes_away():
        q: asyncio.Queue = asyncio.Queue()
        start = starter(engine, loop, "r4", taken, release, asyncio.get_running_loop(), q)
        await loop.acall(start)
        await q.get()  # it is running; then this event loop closes with the request still attached
    asyncio.run(handler_loop_goes_away())
    deadline = time.monotonic() + 10
    while run_in_loop_thread(loop, lambda: "r4" in engine.requests) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loop.fatal is None
    run_in_loop_thread(loop, lambda: assert_all_pages_free(engine))
    # and the engine still serves
    assert asyncio.run(a_few_outputs(engine, loop, "r5", 1, loop.acall))[0].token_ids
