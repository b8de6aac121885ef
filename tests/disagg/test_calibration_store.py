"""Workers of one host that start together with the same calibration key time the steps once:
the first holds the key while it calibrates, the others wait and read its file."""
from __future__ import annotations

import multiprocessing as mp
import time

from services.worker.calibration_store import CalibrationStore
from shared.perf_model.step_model import StepShape

SAMPLES = [(StepShape(prefill_tokens=64, attended_pairs=2080.0), 0.25), (StepShape(decode_rows=4, decode_context=80), 0.125)]


def _calibrate_under_claim(root: str, key: str, holding) -> None:
    store = CalibrationStore(__import__("pathlib").Path(root))
    with store.claim(key):
        holding.set()
        time.sleep(0.5)  # the steps being timed
        store.save(key, SAMPLES)


def test_a_second_worker_waits_for_the_first_ones_calibration_and_reads_it(tmp_path):
    ctx = mp.get_context("spawn")
    holding = ctx.Event()
    first = ctx.Process(target=_calibrate_under_claim, args=(str(tmp_path), "k1", holding))
    first.start()
    try:
        assert holding.wait(60), "the first worker never claimed the key"
        store = CalibrationStore(tmp_path)
        with store.claim("k1"):
            got = store.load("k1")
    finally:
        first.join(30)
    assert got == SAMPLES and first.exitcode == 0


def test_other_keys_and_a_store_that_is_off_never_wait(tmp_path):
    store = CalibrationStore(tmp_path)
    with store.claim("a"), store.claim("b"):  # different keys: independent
        assert store.load("a") is None
    with CalibrationStore(None).claim("a"):
        assert CalibrationStore(None).load("a") is None


def test_an_unreadable_cache_costs_a_calibration_never_the_start(tmp_path):
    store = CalibrationStore(tmp_path)
    (tmp_path / "k2.json").mkdir()  # reading it fails with an OSError, as a file we may not read does
    assert store.load("k2") is None
    store.save("k2", SAMPLES)  # cannot replace a folder: warned and dropped, no raise
    (tmp_path / "plain").write_text("a file, where the store wants a folder")
    blocked = CalibrationStore(tmp_path / "plain" / "calibration")
    with blocked.claim("k3"):  # no lock to take: the start goes on
        assert blocked.load("k3") is None
    blocked.save("k3", SAMPLES)
