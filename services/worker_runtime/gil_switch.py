"""How soon the engine thread gets the GIL back from the worker's gRPC event loop.

The worker runs the engine on one thread and its gRPC services (a message per stream per step)
on an asyncio thread. The engine thread lets the GIL go at every CUDA synchronisation and wait,
and taking it back then waits for the event loop's thread to hand it over: at most Python's
switch interval, 5 ms by default, several times a step. At saturation on one H200 (Qwen3-8B
shape, ShareGPT, 256 streams) a 0.2 ms interval took the stack from 5.96k to 7.73k output
tokens/s and TPOT p50 from 34 to 26 ms (docs/performance/serving.md, "Throughput at saturation").
On the CPU the engine's own threads do the compute and the processes share the cores; a short
interval there only adds switches (9% fewer tokens/s on a 2-core machine), so it stays Python's."""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("duet.worker")

GPU_SWITCH_INTERVAL_MS = 0.2


def switch_interval_ms(setting_ms: float | None, device_type: str) -> float | None:
    """The interval to set, ms: the setting when given (0 or less: leave Python's), else
    GPU_SWITCH_INTERVAL_MS on a GPU; None: leave Python's."""
    if setting_ms is not None:
        return setting_ms if setting_ms > 0 else None
    return GPU_SWITCH_INTERVAL_MS if device_type == "cuda" else None


def apply_switch_interval(setting_ms: float | None, device_type: str) -> None:
    """Set the process's GIL switch interval for an engine on `device_type` (it is process-wide)."""
    ms = switch_interval_ms(setting_ms, device_type)
    if ms is None:
        return
    sys.setswitchinterval(ms / 1000)
    log.info("GIL switch interval %.2f ms (Python's default 5 ms): the engine thread takes the GIL back "
             "sooner from the gRPC thread", ms)
