"""The FP8 device script's helpers (loadtest/bench/fp8_sections.py) on the CPU, so the one
bounded GPU run is not spent on their bugs: teacher-forced logits from one prefill (whole and
in chunks) equal transformers' on the same weights; FP8 layers copy into a dense model as
their dequantized values; the logits comparison; and the script's sections are all wired
into `duet bench --suite fp8`."""
from __future__ import annotations

import torch

from loadtest.bench.fp8_sections import (FP8_SECTIONS, SECTIONS, _gemm_error, compare_logits, copy_dequantized,
                                       teacher_forced_logits)
from shared.engine.engine import Engine
from tests.helpers.engine_models import hf_logits, load_hf
from tests.helpers.fp8_checkpoints import dequantized_checkpoint, quantize_checkpoint
from tests.helpers.tiny_models import make_tiny_model


def test_helpers(tmp_path):
    from shared.engine.model_config import ModelConfig
    from shared.engine.models.loader import load_model
    from shared.engine.parallel.context import TPContext

    src = make_tiny_model(tmp_path / "src", "qwen3")
    q = quantize_checkpoint(src, tmp_path / "fp8", "block", block=(32, 32))
    d = dequantized_checkpoint(q, tmp_path / "dequantized")
    tokens = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    eng = Engine(model_dir=str(q), device="cpu", dtype="float64", kv_cache_memory=4 << 20)
    whole = teacher_forced_logits(eng, tokens)
    chunked = teacher_forced_logits(eng, tokens, chunk=4)
    assert whole.shape == (39, 256) and eng.scheduler.max_batched_tokens == 1024
    want = hf_logits(load_hf(d, torch.float64), tokens)[:39].float()
    for got in (whole, chunked):
        r = compare_logits(got, want)
        assert r["cos_min"] > 0.99999 and r["top1"] == 1.0
    cfg = ModelConfig.from_dir(q)
    kept = load_model(cfg, TPContext(), torch.float32, torch.device("cpu"), 64, keep_fp8=True)
    rows = []

    class Rows:
        def add(self, *row):
            rows.append(row)

    _gemm_error(Rows(), kept)  # on the CPU the kernel path is the reference: no difference
    assert [r[2] for r in rows] == [0.0, 0.0] and all("activation rounding" in r[3] for r in rows), rows
    dense = load_model(cfg, TPContext(), torch.float32, torch.device("cpu"), 64, keep_fp8=False)
    blank = load_model(ModelConfig.from_dir(src), TPContext(), torch.float32, torch.device("cpu"), 64)
    copy_dequantized(kept, blank)
    for (name, a), (_, b) in zip(blank.named_parameters(), dense.named_parameters()):
        assert torch.equal(a, b), name
    assert set(FP8_SECTIONS) - {"ceilings"} == set(SECTIONS)
    from loadtest.bench.suite import SECTION_FUNCS
    assert set(FP8_SECTIONS) <= set(SECTION_FUNCS)


def test_report_against_gives_base_over_setting_and_flags_unequal_tokens():
    """The sections' shared tail (fp8_steps.report_against): the base's step over each setting's, a
    batch at a time, and "NO" when any setting's greedy tokens differ from the base's."""
    from loadtest.bench.fp8_steps import report_against
    from loadtest.bench.suite_context import Report

    got = {("m before", 1): 3.0, ("m now", 1): 2.0, ("m before", 8): 4.0, ("m now", 8): 5.0,
           ("m before", "tokens"): [[1, 2]], ("m now", "tokens"): [[1, 3]]}
    rep = Report()
    report_against(rep, "s", got, "m before", ["m now"], (1, 8), base_label="before", prefix="m ")
    assert rep.data["s"] == {"m B=1 before/now": 1.5, "m B=8 before/now": 0.8, "m 8 rows' greedy tokens equal": "NO"}
    got[("m now", "tokens")] = [[1, 2]]
    rep = Report()
    report_against(rep, "s", got, "m before", ["m now"], (1,))
    assert rep.data["s"] == {"B=1 m before/m now": 1.5, "8 rows' greedy tokens equal": "yes"}
