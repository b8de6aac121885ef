"""GatewayConfig from flags and DUET_* environment; the entry point's argument errors."""

from __future__ import annotations

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.main import main


def test_flags_env_and_backend_choice():
    env = {"DUET_PORT": "9000", "DUET_ROUTER_ADDRESS": "router:50050", "DUET_SERVED_MODEL_NAME": "m",
           "DUET_MAX_MODEL_LEN": "4096"}
    config = GatewayConfig.from_argv([], env)
    assert (config.port, config.backend, config.router_address, config.served_model_name, config.max_model_len) == \
        (9000, "grpc", "router:50050", "m", 4096)
    config = GatewayConfig.from_argv(["--port", "8001", "--backend", "local"], env)
    assert (config.port, config.backend) == (8001, "local")
    assert GatewayConfig.from_argv([], {}).backend == "local"  # no router: in-process engine


def test_grpc_backend_needs_a_router():
    with pytest.raises(ValueError, match="router-address"):
        GatewayConfig.from_argv(["--backend", "grpc"], {})
    assert main(["--backend", "grpc"]) == 2


def test_missing_model_folder_is_a_clean_error(tmp_path, capsys):
    assert main(["--backend", "local", "--model", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
