"""The bound on a stopping worker's exit (services/worker_runtime/exit_watchdog.py), in real
processes: one whose interpreter teardown waits on a thread that never ends exits with status
1 at the bound and says which step it was in, with the stuck thread's stack; one that exits in
time says nothing. And a real worker stopped with SIGTERM logs its drain steps at its default
level (info), so a slow exit can be read from its log. And a service that returned its exit
status ends without the interpreter's teardown (shared/process_exit.py), its exit handlers and
buffered output kept."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from tests.helpers.stack import ProcessStack, managed, new_log_dir

PROGRAM = textwrap.dedent("""
    import sys, threading, time
    from services.worker_runtime.exit_watchdog import ExitWatchdog
    dog = ExitWatchdog(bound_s=float(sys.argv[1]))
    dog.start("leaving the registry")
    dog.enter("exiting (interpreter teardown)")
    if sys.argv[2] == "stuck":
        def wait_forever_on_a_library_call():
            threading.Event().wait()
        threading.Thread(target=wait_forever_on_a_library_call).start()  # not a daemon: exit joins it
    print("main done", flush=True)
""")


def run(bound_s: float, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(bound_s), mode], capture_output=True, text=True,
                          timeout=60)
    return proc, time.monotonic() - started


def test_a_stuck_exit_ends_at_the_bound_naming_the_step_and_the_stuck_thread():
    proc, took = run(1.5, "stuck")
    assert proc.returncode == 1, proc
    assert "main done" in proc.stdout
    assert "stuck in: exiting (interpreter teardown)" in proc.stderr, proc.stderr
    assert "wait_forever_on_a_library_call" in proc.stderr, proc.stderr  # the thread's stack
    assert 1.5 <= took < 30, took


def test_an_exit_in_time_says_nothing():
    proc, took = run(20.0, "clean")
    assert proc.returncode == 0, proc
    assert "stuck in" not in proc.stderr, proc.stderr
    assert took < 20, took


def test_a_worker_logs_its_drain_steps_at_its_default_level(request):
    s = ProcessStack(new_log_dir("drainlog"), kv_cache_memory="32M")
    with managed(request, s):
        s.start_redis()
        s.add_worker("both", "both-0")
        s.wait_registered(["both-0"])
        s.kill("both-0", signal.SIGTERM)
        assert s.procs["both-0"].popen.wait(60) == 0
        log = s.procs["both-0"].log_text()
        steps = ["leaving the registry", "finishing in-flight work", "stopping the gRPC server",
                 "stopping the engine thread", "exiting (interpreter teardown)"]
        at = [log.find(f"stopping: {step}") for step in steps]
        assert -1 not in at and at == sorted(at), log[-3000:]
        assert "stuck in" not in log


FAST_EXIT_PROGRAM = textwrap.dedent("""
    import atexit, sys
    from shared.process_exit import FastExit
    fast_exit = FastExit.install()

    class Teardown:
        def __del__(self):
            print("module teardown ran", flush=True)
    kept = Teardown()  # a module global: only the interpreter's teardown deletes it
    atexit.register(lambda: print("exit handler ran", flush=True))
    sys.stdout.write("unflushed output; ")  # left in the buffer
    if sys.argv[1] == "status":
        fast_exit.code = 3  # what a service command returned (services/cli.py: run)
    sys.exit(3)
""")


def test_a_service_that_returned_its_status_runs_its_exit_handlers_and_skips_the_teardown():
    """shared/process_exit.py: the status kept, buffered output and exit handlers not lost, the
    interpreter's teardown skipped; with no status (an exception, a command that is no service)
    the ordinary exit, teardown included."""
    fast = subprocess.run([sys.executable, "-c", FAST_EXIT_PROGRAM, "status"], capture_output=True, text=True,
                          timeout=60)
    assert fast.returncode == 3, fast
    assert "unflushed output; " in fast.stdout and "exit handler ran" in fast.stdout, fast
    assert "module teardown ran" not in fast.stdout, fast
    ordinary = subprocess.run([sys.executable, "-c", FAST_EXIT_PROGRAM, "none"], capture_output=True, text=True,
                              timeout=60)
    assert ordinary.returncode == 3, ordinary
    assert "exit handler ran" in ordinary.stdout and "module teardown ran" in ordinary.stdout, ordinary
