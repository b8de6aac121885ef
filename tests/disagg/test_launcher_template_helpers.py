"""How many chat-template helpers `duet up` gives its gateway (services/launcher/main.py
template_helpers): every turn of a conversation is rendered and tokenized whole in them, so the
count scales with the machine (half its cores, 2 to 8); --chat-template-processes or the
gateway's own DUET_CHAT_TEMPLATE_PROCESSES wins."""
from __future__ import annotations

from pathlib import Path

from services.launcher.config import UpConfig
from services.launcher.main import Stack, template_helpers


def test_helpers_scale_with_the_cores_within_bounds():
    assert [template_helpers(c) for c in (1, 2, 4, 6, 16, 64)] == [2, 2, 2, 3, 8, 8]


def _gateway_helpers(tmp_path: Path, argv: list[str], env: dict[str, str]) -> int:
    """The --chat-template-processes the planned gateway child is started with (nothing runs)."""
    cfg = UpConfig.from_argv(["--redis-url", "redis://127.0.0.1:1", *argv, "--", "--device", "cpu"], env=env)
    stack = Stack(cfg, tmp_path)
    try:
        stack.plan([str(tmp_path)])
        gateway = next(c for c in stack.children if c.name == "gateway")
        return int(gateway.argv[gateway.argv.index("--chat-template-processes") + 1])
    finally:
        stack.secrets.close()


def test_the_gateway_gets_the_machines_count_unless_told(tmp_path, monkeypatch):
    monkeypatch.setattr("services.launcher.main.os.cpu_count", lambda: 12)
    assert _gateway_helpers(tmp_path, [], {}) == 6
    assert _gateway_helpers(tmp_path, ["--chat-template-processes", "3"], {}) == 3
    assert _gateway_helpers(tmp_path, [], {"DUET_CHAT_TEMPLATE_PROCESSES": "5"}) == 5
