"""The worker's GIL switch interval: short with the engine on a GPU (its thread takes the GIL
back from the gRPC thread sooner), Python's on the CPU, the setting over both."""
import sys

import pytest

from services.worker.config import WorkerConfig
from services.worker_runtime.gil_switch import GPU_SWITCH_INTERVAL_MS, apply_switch_interval


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


@pytest.mark.parametrize("setting_ms, device, expect_ms", [
    (None, "cuda", GPU_SWITCH_INTERVAL_MS),  # auto on a GPU
    (None, "cpu", None),  # auto on the CPU: Python's
    (1.5, "cpu", 1.5),  # the setting wins on either
    (1.5, "cuda", 1.5),
    (0.0, "cuda", None),  # 0: Python's, even on a GPU
])
def test_the_interval_follows_the_device_unless_set(restore_interval, setting_ms, device, expect_ms):
    sys.setswitchinterval(0.005)
    apply_switch_interval(setting_ms, device)
    assert sys.getswitchinterval() == pytest.approx(0.005 if expect_ms is None else expect_ms / 1000)


def test_the_setting_reads_a_flag_an_environment_variable_or_auto():
    assert WorkerConfig.from_argv([]).gil_switch_interval_ms is None
    assert WorkerConfig.from_argv(["--gil-switch-interval-ms", "0.5"]).gil_switch_interval_ms == 0.5
    assert WorkerConfig.from_argv([], env={"DUET_GIL_SWITCH_INTERVAL_MS": "2"}).gil_switch_interval_ms == 2.0
    assert WorkerConfig.from_argv(["--gil-switch-interval-ms", "auto"]).gil_switch_interval_ms is None
    with pytest.raises(SystemExit):  # not a number: argparse's error, exit 2
        WorkerConfig.from_argv(["--gil-switch-interval-ms", "fast"])
