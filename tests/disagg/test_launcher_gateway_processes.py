"""How many gateway processes `duet up` starts (services/launcher/config.py
auto_gateway_processes): by default one per GPU worker, since one process frames about what one
GPU worker streams at saturation, at most a quarter of the cores; one on CPU. Each of several
is told the count (`--gateways`), so together they admit the workers' capacity once."""
from __future__ import annotations

from pathlib import Path

from services.launcher.config import UpConfig, auto_gateway_processes
from services.launcher.main import Stack


def test_one_per_gpu_worker_within_a_quarter_of_the_cores():
    assert auto_gateway_processes(0, 2) == 1  # CPU workers
    assert auto_gateway_processes(1, 16) == 1
    assert auto_gateway_processes(2, 16) == 2
    assert auto_gateway_processes(8, 16) == 4
    assert auto_gateway_processes(8, 128) == 8
    assert auto_gateway_processes(2, 4) == 1


def _gateways(tmp_path: Path, argv: list[str]) -> list[list[str]]:
    """The planned gateway children's command lines (nothing runs)."""
    cfg = UpConfig.from_argv(["--redis-url", "redis://127.0.0.1:1", *argv, "--", "--device", "cpu"], env={})
    stack = Stack(cfg, tmp_path)
    try:
        stack.plan([str(tmp_path)])
        return [c.argv for c in stack.children if c.kind == "gateway"]
    finally:
        stack.secrets.close()


def test_cpu_workers_get_one_gateway_and_a_count_given_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr("services.launcher.main.os.cpu_count", lambda: 64)
    (one,) = _gateways(tmp_path, ["--prefill", "2", "--decode", "2"])
    assert "--gateways" not in one and "--reuse-port" not in one
    three = _gateways(tmp_path, ["--gateway-processes", "3"])
    assert len(three) == 3
    for argv in three:
        assert argv[argv.index("--gateways") + 1] == "3" and "--reuse-port" in argv
