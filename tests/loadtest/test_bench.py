"""`duet bench` on the CPU: each maintained section runs as a dry run on tiny random models and
reports its figures; `--help` lists exactly the sections tested (stack, multiturn and saturation against a
whole `duet up` stack: tests/e2e/test_loadtest_duet_up.py; hetero_tp and failover start their own). The figures
themselves come from GPUs: docs/performance/."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from loadtest.bench.suite import SECTIONS, main

TESTED = {"ceilings", "equality", "decode", "prefill", "offline", "fp8", "spec", "lora", "tp", "tp_fp8", "hetero_tp",
          "stack", "multiturn", "saturation", "failover"}
TINY = ["--models", "qwen3-tiny", "--small-models", "qwen3-tiny", "--batches", "1,2", "--ctx", "32", "--steps", "2"]


def bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--workdir", str(tmp_path / "work"), "--json", str(out), *argv]) == 0
    data = json.loads(out.read_text())
    failed = {s: rows for s, rows in data.items() if any("FAILED" in k or rows[k] == "FAILED" for k in rows)}
    assert not failed, failed
    return data


def test_help_lists_exactly_the_tested_sections():
    help_text = subprocess.run([sys.executable, "-m", "services.cli", "bench", "--help"], capture_output=True,
                               text=True, check=True).stdout
    listed = re.findall(r"^  (\w+) ", help_text.split("sections (run in the order")[1], re.M)
    assert listed == list(SECTIONS)
    assert set(listed) == TESTED


def test_without_a_gpu_it_asks_for_one_or_a_dry_run(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert main(["--sections", "ceilings"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_one_device_sections_report_their_figures(tmp_path, torch_one_thread):
    d = bench(tmp_path, "--sections", "ceilings,equality,decode,prefill,offline,fp8,spec,lora", *TINY,
              "--prefill-len", "32", "--prefill-prompts", "1,2", "--offline-requests", "4")
    assert all(d["ceilings"][k] > 0 for k in ("copy_GB_s", "bf16_matmul_TFLOPs"))
    assert d["equality"]["qwen3-tiny float64 identical sequences"] == "4/4"
    for b in (1, 2):
        assert d["decode"][f"qwen3-tiny B={b} step_ms"] > 0 and d["decode"][f"qwen3-tiny B={b} step_ms overlap"] > 0
        for variant in ("bf16", "fp8", "fp8+fp8kv"):
            assert d["fp8"][f"qwen3-tiny {variant} B={b} step_ms overlap"] > 0
        assert d["fp8"][f"qwen3-tiny B={b} bf16/fp8 step"] > 0
    assert "float8" in d["fp8"]["qwen3-tiny fp8+fp8kv engine"] and "FP8" in d["fp8"]["qwen3-tiny fp8 engine"]
    assert all(d["prefill"][f"qwen3-tiny {n}x32 tok_s"] > 0 for n in (1, 2))
    assert all(d["fp8"][f"qwen3-tiny {n} prompts fp8/bf16 prefill"] > 0 for n in (1, 2))
    assert d["offline"]["overlap on/off identical sequences"] == "4/4"
    assert d["offline"]["qwen3-tiny overlap=on out_tok_s"] > 0
    assert d["spec"]["B=1 ngram K=4 accept-all tok_s"] > 0 and d["spec"]["B=1 draft K=4 accept-all tok_s"] > 0
    for count in (0, 1, 8):  # distinct LoRA adapters in the batch, beside the same steps without LoRA
        assert all(d["lora"][f"qwen3-tiny {count} adapters B={b} step_ms"] > 0 for b in (1, 2))
        assert d["lora"][f"qwen3-tiny {count} adapters prefill tok_s"] > 0
    assert d["lora"]["qwen3-tiny no LoRA B=1 step_ms"] > 0
    assert d["spec"]["ngram greedy == plain"] is True and d["spec"]["draft greedy == plain"] is True


def test_tp_section_reports_equal_tokens_and_both_steps(tmp_path, torch_one_thread):
    d = bench(tmp_path, "--sections", "tp", *TINY)["tp"]
    assert d["qwen3-tiny TP2/EP1 == TP1 sequences"] == "6/6"
    for b in (1, 2):
        assert d[f"qwen3-tiny TP=1 B={b} step_ms"] > 0 and d[f"qwen3-tiny TP=2 B={b} step_ms"] > 0
        assert d[f"qwen3-tiny B={b} TP2/TP1"] > 0


def test_tp_fp8_section_reports_equal_tokens_host_hits_and_both_steps(tmp_path, torch_one_thread):
    d = bench(tmp_path, "--sections", "tp_fp8", *TINY[:2], "--small-models", "qwen3-tiny", "--batches", "1",
              "--ctx", "16", "--steps", "1")["tp_fp8"]
    for case in ("fp8 KV", "fp8 weights"):  # float64 on the CPU: the split sums round too little to move a token
        assert d[f"qwen3-tiny {case} TP2 == TP1 sequences"] == "6/6"
    assert d["qwen3-tiny host tier TP2 == TP1 sequences"] == "12/12"
    tp1, tp2 = (int(x) for x in d["qwen3-tiny host tier TP1 / TP2 host-hit tokens"].split(" / "))
    assert tp1 == tp2 == 4 * 6 * 16, "round 3's four 6-page prefixes came back from the host tier at both sizes"
    for variant in ("fp8", "fp8+fp8kv"):
        assert d[f"qwen3-tiny {variant} TP=1 B=1 step_ms"] > 0 and d[f"qwen3-tiny {variant} TP=2 B=1 step_ms"] > 0


@pytest.mark.slow
def test_hetero_tp_section_hands_kv_from_prefill_tp2_to_decode_tp1(tmp_path, torch_one_thread):
    """A `duet up` stack on the CPU, prefill TP=2 over gloo into decode TP=1 (the equal layout is the
    same code with one rank): the stack's greedy text equals the offline engine's, and every prompt's
    handoff was seen at the prefill worker."""
    d = bench(tmp_path, "--sections", "hetero_tp", "--models", "qwen3-tiny", "--hetero-lens", "64,160",
              "--hetero-trials", "1", "--hetero-layouts", "2->1")["hetero_tp"]
    assert d["2->1 greedy == offline TP1"] == "2/2"
    assert all(d[f"2->1 {n} tokens handoff tail ms"] > 0 for n in (64, 160))


def test_planner_switches_are_counted_from_the_planners_log(tmp_path):
    from loadtest.bench.stacks import planner_activity

    assert planner_activity(None) is None and planner_activity(tmp_path) is None  # no planner: no count
    line = "2026-11-28 07:27:12,252 INFO duet.planner: planner {} ({}): 1p1d -> 2b; now score 1.16\n"
    (tmp_path / "planner.log").write_text(line.format("switch", "slo") + line.format("hold", "backlog") +
                                          line.format("switch", "headroom"))
    assert planner_activity(tmp_path).switches == 2
    before = planner_activity(tmp_path)
    with (tmp_path / "planner.log").open("a") as log:
        log.write(line.format("hold", "backlog") + line.format("hold", "dwell") +
                  "2026-11-28 07:27:13,100 INFO duet.planner: planner: worker-1 handed 7 of 9 decoding stream(s) over "
                  "to the new split\n")
    did = planner_activity(tmp_path).since(before)
    assert (did.switches, did.backlog_holds, did.handed_over) == (0, 1, 7)
    assert did.text() == "0 planner switches, 1 backlog holds, 7 streams handed over"


def test_failover_gaps_split_moved_streams_from_bystanders():
    from loadtest.bench.failover_gaps import StreamTimes, failover_gaps, longest_gap, ms

    killed_at = 0.25
    streams = [StreamTimes([0.0, 0.1, 0.2, 1.2, 1.3], moved=True),  # 1 s without a token across the kill
               StreamTimes([0.0, 0.1, 0.2, 0.9], moved=True),
               StreamTimes([0.0, 0.1, 0.2, 0.5, 0.6], moved=False),  # a bystander: streamed through the kill
               StreamTimes([0.0, 0.1, 0.15], moved=False),  # ended before the kill: neither
               StreamTimes([0.3], moved=False)]  # one chunk: no gap at all
    g = failover_gaps(streams, killed_at)
    assert g.moved == pytest.approx([1.0, 0.7]) and g.bystanders == pytest.approx([0.3])
    assert g.before_kill == pytest.approx([0.1] * 7 + [0.05])
    assert (ms(g.moved, 50), ms(g.moved, 100), ms(g.bystanders, 50), ms([], 50)) == (850.0, 1000.0, 300.0, None)
    assert longest_gap([1.0]) is None and longest_gap([]) is None


@pytest.mark.slow
def test_failover_section_moves_the_killed_workers_streams(tmp_path, torch_one_thread):
    """`duet up` with one prefill and two decode workers on the default model, on the CPU: the decode
    worker running the most streams is SIGKILLed mid-stream, its streams move to the other one and
    end as the unfaulted run does, and the KV they got back is counted."""
    from shared.model_files.default_model import ensure_default_model

    d = bench(tmp_path, "--sections", "failover", "--model-dir", str(ensure_default_model()), "--failover-modes",
              "moved", "--failover-streams", "8", "--stack-lens", "64,24", "--failover-after", "4")["failover"]
    assert d["moved killed worker's streams"] >= 1
    assert d["moved streams moved"] >= 1 and d["moved streams failed"] == 0
    assert d["moved == unfaulted sequences"] == "8/8"
    held, moved, recomputed = (int(x) for x in d["moved KV rebuilt tokens held/moved/recomputed"].split("/"))
    assert held + moved > 0 and recomputed > 0  # the prompts' pages from prefill's cache, the streamed tokens again
    # chunks a busy client reads from one socket read arrive 0.0 ms apart, so the median gap
    # before the kill may be 0 on a loaded machine (seen in a whole-suite run); it is measured
    assert d["moved moved longest gap p50 ms"] > 0 and d["moved ITL p50 ms before the kill"] >= 0


def test_a_stack_on_a_cpu_shape_takes_every_id_of_the_tokenizer(tmp_path):
    """qwen3-tiny's 512-token vocabulary under the default model's tokenizer (49k ids): the random
    checkpoint the stack sections start is widened to the tokenizer, or the gateway refuses the
    load's prompts (a 400 for ids past the vocabulary)."""
    import json
    from types import SimpleNamespace

    from loadtest.bench.stacks import stack_model
    from transformers import AutoTokenizer

    run = SimpleNamespace(args=SimpleNamespace(model_dir=None, models="qwen3-tiny", tokenizer_from=None),
                          root=tmp_path, names=lambda text: text.split(","))
    folder, flags = stack_model(run)
    config = json.loads((folder / "config.json").read_text())
    assert flags == ["--load-format", "dummy"] and config["hidden_size"] == 64  # the tiny shape still
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(folder)) > 512
