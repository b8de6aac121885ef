"""The step watchdog (services/worker_runtime/step_watchdog.py) on a real EngineLoop over a real
CPU engine: an iteration that never returns (here a role tick that blocks, as a GPU call or a
collective waiting on a dead rank would) ends the process with status 1 after `--step-timeout`,
with every thread's stack (the blocked frame among them) on stderr; a loop that keeps going,
however slow each iteration, or an idle one, is left alone. The exit is the one thing replaced:
the test records it instead of ending pytest."""
from __future__ import annotations

import threading
import time

import pytest

from services.worker.config import WorkerConfig
from services.worker_runtime.engine_loop import EngineLoop
from services.worker_runtime.step_watchdog import StepWatchdog
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import build_model_dir, random_prompts

KIND = "llama_tied_gqa2"
BOUND_S = 0.6

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("step_watchdog") / KIND, KIND, seed=7)


@pytest.fixture
def loop(model_dir):
    engine = Engine(model_dir=str(model_dir), dtype="float32", device="cpu", page_size=4)
    loop = EngineLoop(engine)
    loop.start()
    yield loop
    loop.stop()


def watched(loop) -> tuple[StepWatchdog, list[int], threading.Event, list[float]]:
    exits: list[int] = []
    iteration_ran_s: list[float] = []  # how long the stuck iteration had run when the exit came
    fired = threading.Event()

    def exit_(status: int) -> None:
        iteration_ran_s.append(time.perf_counter() - loop.iteration_began)
        exits.append(status)
        fired.set()
    dog = StepWatchdog(loop, BOUND_S, exit=exit_)
    dog.start()
    return dog, exits, fired, iteration_ran_s


def blocked_tick(release: threading.Event):
    def tick_that_never_returns() -> bool:
        release.wait(30)
        return False
    return tick_that_never_returns


def test_an_iteration_that_never_returns_ends_the_process_with_every_threads_stack(loop, capfd):
    release = threading.Event()
    # a request keeps the engine stepping; the hang comes after a step, in a role's tick
    loop.call(lambda: loop.engine.add_request(random_prompts(1, [12], seed=3)[0],
                                              SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))).result(10)
    dog, exits, fired, iteration_ran_s = watched(loop)
    started = time.monotonic()
    loop.add_tick(blocked_tick(release))
    try:
        assert fired.wait(10), "the watchdog never fired"
        took = time.monotonic() - started
    finally:
        release.set()
        dog.stop()
    assert exits == [1]
    # the bound counts from the iteration's start, which may come a step before the tick was added
    assert iteration_ran_s[0] >= BOUND_S, iteration_ran_s
    assert took < BOUND_S + 2.0, took
    err = capfd.readouterr().err
    assert "one engine-loop iteration has run for" in err and "--step-timeout" in err
    assert "tick_that_never_returns" in err and "engine-loop" in err  # the stuck thread's stack names the frame


def test_slow_iterations_that_keep_returning_and_an_idle_loop_are_left_alone(loop):
    dog, exits, _, _ = watched(loop)
    slow = threading.Event()

    def slow_tick() -> bool:  # each iteration takes most of the bound, none passes it
        if slow.is_set():
            time.sleep(0.8 * BOUND_S)
        return False
    loop.add_tick(slow_tick)
    slow.set()
    time.sleep(5 * BOUND_S)
    slow.clear()
    time.sleep(3 * BOUND_S)  # idle: waiting for commands is not an iteration
    dog.stop()
    assert exits == []


def test_the_setting():
    assert WorkerConfig.from_argv([]).step_timeout_s == 300.0
    assert WorkerConfig.from_argv(["--step-timeout", "0"]).step_timeout_s == 0.0
    assert WorkerConfig.from_argv([], env={"DUET_STEP_TIMEOUT": "45"}).step_timeout_s == 45.0
    with pytest.raises(ValueError, match="--step-timeout must be >= 0"):
        WorkerConfig.from_argv(["--step-timeout", "-1"])
    watching = lambda: sum(t.name == "step-watchdog" for t in threading.enumerate())  # noqa: E731
    before = watching()
    StepWatchdog(object(), 0.0, exit=lambda status: pytest.fail("a 0 bound watched")).start()
    assert watching() <= before  # 0: no thread at all
