"""Start-up calibrations kept on disk: a worker started again with the same checkpoint, device,
engine plan and step limits reuses the steps it timed last time instead of timing them again
(3-6 s of a CPU worker's start, ~5 s of a GPU worker's). The samples only seed the step-time
model; live steps correct it from the first request on (shared/perf_model/worker_perf.py),
so a stale file costs a few steps of worse placement, never a wrong answer.

One JSON file a key, written whole under a temporary name and renamed, so workers starting
side by side never read half a file; a file that does not parse is ignored and rewritten. Workers
that start together with the same key take turns (claim): the first times the steps, the others
read them."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from shared.perf_model.step_model import StepShape

log = logging.getLogger("duet.worker.perf")

# bump when perf_calibration.py's shapes change: older files then stop matching
SHAPES_VERSION = 1
# a worker waits this long for another one calibrating the same key, then times its own steps
CLAIM_WAIT_S = 60.0


def calibration_key(engine, checkpoint: str) -> str:
    """What the timed steps depend on: the weights, the device, the plan, the step limits."""
    import torch

    device = engine.device
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} cuda {torch.version.cuda}"
    else:
        where = f"{platform.machine()} {platform.processor()} cpus={os.cpu_count()} threads={torch.get_num_threads()}"
    parts = {
        "shapes": SHAPES_VERSION, "checkpoint": checkpoint, "device": where, "torch": torch.__version__,
        "plan": engine.plan.render(), "tp": engine.tp.size,
        "step_tokens": engine.scheduler.max_batched_tokens, "max_running": engine.config.max_running_requests,
        "kv_pages": engine.kv.capacity, "page_size": engine.layout.page_size, "max_len": engine.max_model_len,
    }
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=12).hexdigest()


class CalibrationStore:
    """root None: off (every start times its steps)."""

    def __init__(self, root: Path | None):
        self.root = root

    @contextlib.contextmanager
    def claim(self, key: str):
        """Hold the key while calibrating, so workers of one host that start together time the
        steps once: the others wait (at most CLAIM_WAIT_S: a stuck one never holds them) and then
        find the file. The lock is the kernel's (flock): it goes with the process that held it."""
        if self.root is None:
            yield
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / f".{key}.lock", "w")
        except OSError:
            yield
            return
        with lock:
            deadline = time.monotonic() + CLAIM_WAIT_S
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        log.warning("perf calibration: another worker has held %s for %.0fs; timing my own",
                                    key, CLAIM_WAIT_S)
                        break
                    time.sleep(0.1)
            yield

    def load(self, key: str) -> list[tuple[StepShape, float]] | None:
        if self.root is None:
            return None
        path = self.root / f"{key}.json"
        try:
            rows = json.loads(path.read_text())
            return [(StepShape(**shape), float(seconds)) for shape, seconds in rows]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as exc:  # unreadable (a read-only or foreign cache) or torn
            log.warning("perf calibration: ignoring %s (%s)", path, exc)
            return None

    def save(self, key: str, samples: list[tuple[StepShape, float]]) -> None:
        if self.root is None or not samples:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{key}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump([[asdict(shape), seconds] for shape, seconds in samples], f)
            os.replace(tmp, self.root / f"{key}.json")
        except OSError as exc:  # a read-only cache costs the next start its calibration, nothing else
            log.warning("perf calibration: not kept (%s)", exc)
