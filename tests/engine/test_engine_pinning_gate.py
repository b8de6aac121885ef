"""When the host tier's background page-locking may take its next chunk (Engine._may_pin): a
registration holds the driver's lock the next launch waits on, so never while a step is built or
still runs on the device (the overlap scheduler's launched step not read back yet), however long
ago it was launched: a long prefill step is no pause. The pinner itself needs cudaHostRegister
(a GPU); the gate it asks is the engine's, checked here on the CPU."""
from __future__ import annotations

import pytest

from shared.engine import Engine, SamplingParams

from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(model_dir=str(make_tiny_model(tmp_path_factory.mktemp("pin") / "qwen3", "qwen3")), device="cpu",
                 dtype="float64", overlap_schedule=True)
    yield eng
    eng.close()


def test_the_tier_locks_only_while_no_step_is_built_or_running(engine):
    long_ago = 0.0  # time.monotonic() long before now: past PIN_IDLE_S since the last launch
    engine.runner.last_forward_at = long_ago
    assert engine._may_pin()  # idle since start-up

    during = []
    engine.runner.plan_sink = lambda plan: during.append(engine._may_pin())  # inside step(), at the launch
    try:
        engine.add_request([5, 6, 7, 8, 9] * 4, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        engine.step()
        assert during == [False]
        assert engine.overlap.pending is not None  # launched, not read back: the device may still run it
        engine.runner.last_forward_at = long_ago
        assert not engine._may_pin()  # a long step is no pause
        while engine.has_work:
            engine.step()
        assert all(not ok for ok in during)
    finally:
        engine.runner.plan_sink = None
    assert engine.overlap.pending is None
    assert not engine._may_pin()  # the last launch was just now
    engine.runner.last_forward_at = long_ago
    assert engine._may_pin()  # idle again


def test_the_gate_answers_from_the_moment_the_tier_exists(tmp_path):
    """The pinning thread starts with the host tier, before the engine has its runner, graphs or
    overlap scheduler, and asks the gate at once: it must say "not yet", not raise (a raise ends
    the locking for good and leaves the whole tier unused)."""
    asked = []

    class Asking(Engine):
        def _make_host_tier(self):
            asked.append(self._may_pin())  # what the pinner's first _wait_turn sees
            return super()._make_host_tier()

    eng = Asking(model_dir=str(make_tiny_model(tmp_path / "qwen3", "qwen3")), device="cpu", dtype="float64",
                 overlap_schedule=True)
    try:
        assert asked == [False]
        eng.runner.last_forward_at = 0.0
        assert eng._may_pin()  # start-up done, idle
    finally:
        eng.close()
