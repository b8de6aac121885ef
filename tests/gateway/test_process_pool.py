"""shared/process_pool: helper processes with a hard time budget per call. Real processes:
results and the function's own errors come back as they are, a call past its budget kills
its helper (the next call gets a fresh one), a dead helper or a failed setup is a
CallFailed, calls from asyncio leave the event loop free, and a helper whose parent was
killed exits on its own."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from shared.process_pool.pool import CallFailed, CallTimeout, ProcessPool
from tests.helpers.gateway_support import wait_until

pytestmark = pytest.mark.timeout(180)
T = "tests.helpers.pool_targets"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pool():
    p = ProcessPool("test", f"{T}:setup", ("tag",), processes=2)
    yield p
    p.close()


def test_calls_return_results_and_raise_the_functions_errors(pool):
    tag, value, calls, pid = pool.call_sync(f"{T}:echo", {"a": [1, 2]}, timeout_s=60)
    assert (tag, value) == ("tag", {"a": [1, 2]}) and calls >= 1 and pid != os.getpid()
    assert pool.call_sync(f"{T}:noisy", timeout_s=10) == "still fine"  # print() does not corrupt replies
    with pytest.raises(ValueError, match="boom"):
        pool.call_sync(f"{T}:fail", "boom", timeout_s=10)
    assert pool.call_sync(f"{T}:echo", 2, timeout_s=10)[1] == 2  # the helper kept serving


def test_a_call_past_its_budget_kills_its_helper_and_the_next_call_gets_a_fresh_one(pool):
    pool.call_sync(f"{T}:echo", 0, timeout_s=60)
    timeouts = pool.stats.timeouts
    started = time.monotonic()
    with pytest.raises(CallTimeout):
        pool.call_sync(f"{T}:spin", 30.0, timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert pool.stats.timeouts == timeouts + 1
    live = {c.pid for c in psutil.Process().children(recursive=True) if live_helper(c)}
    assert len(live) <= pool.processes + 1  # the zygote and its helpers: the killed one is gone
    assert pool.call_sync(f"{T}:echo", 3, timeout_s=60)[1] == 3


def live_helper(c: psutil.Process) -> bool:
    """A pool process still running (the killed helper may be a zombie, or reaped, between two looks)."""
    try:
        return c.status() != psutil.STATUS_ZOMBIE and "shared.process_pool.zygote" in " ".join(c.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return False


def gone(pid: int) -> bool:
    """No such process, or a zombie (its reaping may land between two looks)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_helper_is_replaced_from_the_setup_already_made():
    """The replacement of a helper killed at its budget is forked from the zygote that ran the
    setup once: no new interpreter, imports or setup (the grammar helper's took 10-20 s on a
    loaded machine while the next client's grammar waited)."""
    pool = ProcessPool("zygote", f"{T}:setup", ("z",), processes=1)
    try:
        setup_pid, first = pool.call_sync(f"{T}:origin", timeout_s=60)
        assert setup_pid != first and setup_pid != os.getpid()
        assert psutil.Process(first).ppid() == setup_pid  # forked from the process that ran the setup
        with pytest.raises(CallTimeout):
            pool.call_sync(f"{T}:spin", 30.0, timeout_s=0.5)
        assert gone(first)
        again_setup, second = pool.call_sync(f"{T}:origin", timeout_s=60)
        assert (again_setup, pool.stats.setups, pool.stats.started) == (setup_pid, 1, 2)
        assert second != first
    finally:
        pool.close()
    assert not psutil.pid_exists(setup_pid)  # closing the pool ended (and reaped) the zygote


def test_a_dead_helper_and_a_failed_setup_are_call_failed(pool):
    with pytest.raises(CallFailed) as dead:
        pool.call_sync(f"{T}:die", timeout_s=30)
    assert not dead.value.during_setup
    assert pool.call_sync(f"{T}:echo", 4, timeout_s=60)[1] == 4
    bad = ProcessPool("bad", f"{T}:bad_setup")
    try:
        with pytest.raises(CallFailed) as failed:
            bad.call_sync(f"{T}:echo", 1, timeout_s=10)
        assert failed.value.during_setup and "no such thing" in str(failed.value)
    finally:
        bad.close()


def test_ready_after_a_first_start_and_a_failed_start_is_tried_again(tmp_path):
    """What a readiness check reads: not ready until a helper has set up; a failed start says
    why, and ensure_starting() tries again (not on every check while one is starting)."""
    flag = tmp_path / "ready"
    pool = ProcessPool("late", f"{T}:setup_once_exists", (str(flag),))
    try:
        assert not pool.ready and pool.start_error is None
        pool.prestart()
        assert wait_until(lambda: pool.start_error is not None, 60), "the first start did not fail"
        assert not pool.ready and "is not there yet" in pool.start_error
        started = pool.stats.started
        flag.touch()
        pool.ensure_starting()
        assert wait_until(lambda: pool.ready, 60), pool.start_error
        assert pool.start_error is None and pool.stats.started == started + 1
        pool.ensure_starting()  # ready: nothing more starts
        assert pool.call_sync(f"{T}:echo", 5, timeout_s=60)[:2] == ("late", 5)
        assert pool.stats.started == started + 1
    finally:
        pool.close()


def test_a_call_takes_the_started_helper_before_an_unstarted_slot():
    """prestart(1) on a pool of two (what the gateway does): the first call is answered by the
    helper that started, not by starting the second one (a call would wait for its start)."""
    pool = ProcessPool("first", f"{T}:setup", ("first",), processes=2)
    try:
        pool.prestart(1)
        assert wait_until(lambda: pool.ready, 60), pool.start_error
        pids = {pool.call_sync(f"{T}:echo", i, timeout_s=60)[3] for i in range(3)}
        assert pool.stats.started == 1 and len(pids) == 1, (pool.stats.started, pids)
    finally:
        pool.close()


def test_async_calls_leave_the_event_loop_free_and_queue_beyond_the_helpers(pool):
    async def scenario():
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
        tick = asyncio.create_task(ticker())
        results = await asyncio.gather(*(pool.call(f"{T}:sleep", 0.3, timeout_s=30) for _ in range(4)))
        stop.set()
        await tick
        return results, max(gaps)

    pool.call_sync(f"{T}:echo", 0, timeout_s=60)  # helpers started outside the measurement
    pool.prestart()
    results, worst_gap = asyncio.run(scenario())
    assert results == [0.3] * 4
    assert worst_gap < 0.25, worst_gap


def test_a_helper_exits_when_its_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from shared.process_pool.pool import ProcessPool
        pool = ProcessPool("orphan", "{T}:setup", ("x",))
        print(pool.call_sync("{T}:echo", 1, timeout_s=60)[3], flush=True)
        pool.call_sync("{T}:sleep", 600, timeout_s=900)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        helper = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.5)  # the helper is in its long call now
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        helper.wait(10)  # psutil.TimeoutExpired if it outlived its parent
    finally:
        if parent.poll() is None:
            parent.kill()


def test_stop_kills_the_helpers_and_the_pool_starts_fresh_ones_after():
    pool = ProcessPool("stoppable", f"{T}:setup", ("s",), processes=1)
    try:
        first = psutil.Process(pool.call_sync(f"{T}:echo", 1, timeout_s=60)[3])
        pool.stop()
        first.wait(10)  # gone
        assert pool.call_sync(f"{T}:echo", 2, timeout_s=60)[3] != first.pid
    finally:
        pool.close()


def test_ctrl_c_to_the_group_leaves_the_helpers_to_their_parent(tmp_path):
    """A terminal's Ctrl-C signals the whole process group: the helper neither dies nor
    writes a KeyboardInterrupt trace; it answers on and stops when its parent closes it."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys
        from shared.process_pool.pool import ProcessPool
        signal.signal(signal.SIGINT, lambda *_: None)  # this parent keeps going (a handler: not inherited)
        pool = ProcessPool("group", "{T}:setup", ("g",))
        print(pool.call_sync("{T}:echo", 1, timeout_s=60)[3], flush=True)
        sys.stdin.readline()  # the test has sent Ctrl-C to the group
        print(pool.call_sync("{T}:echo", 2, timeout_s=60)[1], flush=True)
        pool.close()
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        helper = psutil.Process(int(parent.stdout.readline()))
        os.killpg(parent.pid, signal.SIGINT)
        time.sleep(0.5)
        assert helper.is_running() and helper.status() != psutil.STATUS_ZOMBIE
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "2"  # the same helper still answers
        parent.wait(30)
        helper.wait(10)  # closed with its pool
        assert "KeyboardInterrupt" not in parent.stderr.read()
    finally:
        if parent.poll() is None:
            parent.kill()
