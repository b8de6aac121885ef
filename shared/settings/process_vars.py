"""DUET_* variables read outside any command's settings dataclass, declared here so that
`duet env` lists every variable Duet reads."""
from __future__ import annotations

from shared.settings.spec import variable

LOG_LEVELS = ("debug", "info", "warning", "error")

# `duet --log-level` sets it for the command it runs; generate and chat log less by default
CLI_LOG_LEVEL = variable(
    "DUET_LOG_LEVEL", "warning", read_by=("duet", "generate", "chat"),
    help="stderr log level (the services read it too, default info)")
CACHE_DIR = variable(
    "DUET_CACHE_DIR", None, read_by=("worker", "gateway", "up", "generate", "chat", "convert-default-model"),
    help="where the embedded default model is converted to (default: $XDG_CACHE_HOME/duet or ~/.cache/duet)")
# the TP launcher's handshake with the rank processes it starts (shared/engine/parallel/launcher.py,
# follower.py);
# "tp-rank": those processes, whatever command started the engine
TP_ADDR = variable("DUET_TP_ADDR", None, read_by=("tp-rank",), internal=True,
                   help="host:port of rank 0's control socket, for a tensor-parallel rank process")
TP_KEY = variable("DUET_TP_KEY", None, read_by=("tp-rank",), internal=True, help="that socket's auth key (hex)")

VARIABLES = (CLI_LOG_LEVEL, CACHE_DIR, TP_ADDR, TP_KEY)
