"""The engine plan (shared/engine/plan.py, plan_resolve.py): every start-time choice resolved once
from the settings, the device and the model's config, each with its reason; frozen; one line
naming every choice, which the engine logs at start and `duet env --plan` prints. GPU plans
are resolved here from a described device (DeviceFacts): resolving loads nothing."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.engine.config import EngineConfig
from shared.engine.model_config import ModelConfig
from shared.engine.plan import DeviceFacts, EnginePlan
from shared.engine.plan_resolve import plan_for, resolve_plan
from tests.helpers.engine_models import MOE_CONFIGS, SMALL_CONFIGS, build_model_dir, make_config

REPO = Path(__file__).resolve().parents[2]
CPU = DeviceFacts("cpu", host_available=8 << 30)
H100 = DeviceFacts("cuda", 0, "NVIDIA H100 80GB HBM3", (9, 0), triton=True, pdl=True, tma=True,
                   host_available=64 << 30)
A100 = DeviceFacts("cuda", 0, "NVIDIA A100-SXM4-80GB", (8, 0), triton=True, host_available=64 << 30)
CHOICES = [f.name for f in dataclasses.fields(EnginePlan) if f.name != "facts"]


def _config_dir(tmp_path: Path, kind: str, **overrides) -> Path:
    """A model folder with config.json alone: the plan needs no weights."""
    path = tmp_path / kind
    cfg = make_config(kind, **overrides)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.save_pretrained(path)
    return path


def _names_every_choice(plan: EnginePlan) -> None:
    line = plan.render()
    assert "\n" not in line
    pairs = dict(item.split("=", 1) for item in line.split(" "))
    assert list(pairs) == CHOICES
    assert all(d.why and " " not in d.shown for _, d in plan.choices())


def test_the_default_model_on_the_cpu():
    plan = plan_for(EngineConfig(device="cpu"))
    _names_every_choice(plan)
    assert plan.render() == ("device=cpu tp=1 dtype=float32 weights=float32 kernels=torch attention=torch "
                             "kv_dtype=float32 linears=off fp8_decode_gemm=off pdl=off custom_all_reduce=none "
                             "decode_graphs=none prefill_graphs=off overlap=on host_tier=off speculative=off lora=off "
                             "max_model_len=8192 step_tokens=1024")
    assert plan.host_tier.why == "auto on the CPU: its pool is host memory already"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.overlap = plan.pdl
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.overlap.value = False


@pytest.mark.parametrize("kind", sorted(SMALL_CONFIGS) + sorted(MOE_CONFIGS))
@pytest.mark.parametrize("facts", [CPU, H100], ids=["cpu", "h100"])
def test_every_tiny_model_resolves(tmp_path, kind, facts):
    plan = resolve_plan(EngineConfig(), ModelConfig.from_dir(_config_dir(tmp_path, kind)), facts)
    _names_every_choice(plan)
    assert plan.facts is facts and plan.max_model_len.value == 512
    assert (plan.decode_graphs.value is not None) == (facts.type == "cuda")


def test_a_gpu_plan(tmp_path):
    mc = ModelConfig.from_dir(_config_dir(tmp_path, "qwen3_tied_gqa4"))
    plan = resolve_plan(EngineConfig(cuda_graph_max_bs=64), mc, H100)
    assert plan.device.shown == "cuda:0(H100_80GB_HBM3,sm90)" and plan.dtype.value == "bfloat16"
    assert (plan.kernels.value, plan.attention.value, plan.overlap.value) == (True, "triton", True)
    assert plan.decode_graphs.value.sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert plan.decode_graphs.value.capture and plan.decode_graphs.shown == "1-64/11"
    assert plan.prefill_graphs.value == 512 and plan.step_tokens.value == 8192
    # shapes no sweep tuned: the LM head on the split-K kernel, the others on cuBLAS
    assert plan.linears.shown == "auto(lm_head:1-16,qkv:cuBLAS,o:cuBLAS,gate_up:cuBLAS,down:cuBLAS)"
    assert resolve_plan(EngineConfig(small_batch_linear="all"), mc, H100).linears.shown == \
        "all(lm_head:1-16,qkv:1-16,o:1-16,gate_up:1-16,down:1-16)"
    assert plan.pdl.value.pdl.max_rows == 1 and plan.pdl.shown == "rows<=1"  # 16-bit dense: batch 1
    assert plan.host_tier.value.budget is None and plan.host_tier.value.cap == 16 << 30
    assert plan.fp8_decode_gemm.shown == "off" and plan.custom_all_reduce.shown == "none"
    knobs = resolve_plan(EngineConfig(pdl_prefetch_k_blocks=2, pdl_prefetch_at={"o_proj": 8}), mc, H100)
    assert knobs.pdl.shown == "rows<=1,prefetch2,o_proj=8" and knobs.pdl.value.prefetch_at == (("o_proj", 8),)
    off = resolve_plan(EngineConfig(cuda_graph=False, pdl="off", kv_host_memory=0, overlap_schedule=False), mc, H100)
    assert (off.decode_graphs.shown, off.prefill_graphs.value, off.pdl.value, off.host_tier.value, off.overlap.value) \
        == ("eager(1-256/23)", 0, None, None, False)
    assert off.decode_graphs.why.startswith("--disable-cuda-graph")
    older = resolve_plan(EngineConfig(), mc, A100)
    assert older.pdl.value is None and "sm90" in older.pdl.why
    # a prefill worker never runs a decode step: no decode graphs, its small prefill steps keep theirs
    prefill = resolve_plan(EngineConfig(runs_decode=False), mc, H100)
    assert prefill.decode_graphs.value is None and prefill.decode_graphs.why == "a prefill worker runs no decode step"
    assert prefill.prefill_graphs.value == 512


def test_fp8_weights_take_the_decode_gemm_on_hopper_only(tmp_path):
    mc = ModelConfig.from_dir(_config_dir(tmp_path, "qwen3_tied_gqa4"), quantization="fp8")
    plan = resolve_plan(EngineConfig(quantization="fp8"), mc, H100)
    assert (plan.weights.value, plan.fp8_decode_gemm.value, plan.pdl.value.pdl.max_rows) == ("fp8", 32, 32)
    assert plan.linears.shown.endswith("qkv:fp8,o:fp8,gate_up:fp8,down:fp8)")
    assert resolve_plan(EngineConfig(quantization="fp8", fp8_decode_gemm="off"), mc, H100).fp8_decode_gemm.value == 0
    assert "Hopper" in resolve_plan(EngineConfig(quantization="fp8"), mc, A100).fp8_decode_gemm.why
    cpu = resolve_plan(EngineConfig(quantization="fp8"), mc, CPU)
    assert cpu.weights.shown == "float32(from-fp8)" and cpu.fp8_decode_gemm.value == 0


def test_tensor_parallel_choices_and_the_all_reduce_fallback(tmp_path):
    mc = ModelConfig.from_dir(_config_dir(tmp_path, "qwen3_tied_gqa4"))
    plan = resolve_plan(EngineConfig(tp_size=2), mc, H100)
    assert (plan.tp.shown, plan.custom_all_reduce.value, plan.overlap.value) == ("2(rank0)", "fused", True)
    assert plan.decode_graphs.value.capture and plan.pdl.value.pdl.max_rows == 1
    # the ranks could not set the custom all-reduce up: NCCL, and graphs and overlap follow
    failed = resolve_plan(EngineConfig(tp_size=2), mc, H100, custom_all_reduce_failed="no P2P")
    assert (failed.custom_all_reduce.shown, failed.decode_graphs.value.capture, failed.overlap.value) == \
        ("nccl", False, False)
    assert "no P2P" in failed.custom_all_reduce.why and "NCCL" in failed.decode_graphs.why
    nccl = resolve_plan(EngineConfig(tp_size=2, custom_all_reduce=False, overlap_schedule=True), mc, H100)
    assert (nccl.custom_all_reduce.shown, nccl.overlap.value) == ("nccl", True)
    assert resolve_plan(EngineConfig(tp_size=2), mc, CPU).custom_all_reduce.shown == "gloo"
    follower = EngineConfig(tp_size=2, speculative_method="ngram")
    follower.tp = dataclasses.replace(follower.tp, rank=1, size=2)
    assert resolve_plan(follower, mc, H100).speculative.value is None
    assert resolve_plan(EngineConfig(speculative_method="ngram"), mc, CPU).speculative.shown == "ngram(k=4)"


def test_combinations_the_engine_cannot_run_are_refused(tmp_path):
    dense = ModelConfig.from_dir(_config_dir(tmp_path, "qwen3_tied_gqa4"))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        resolve_plan(EngineConfig(tp_size=2, ep_size=2), dense, CPU)
    with pytest.raises(ValueError, match="not divisible by 3"):
        resolve_plan(EngineConfig(tp_size=3), dense, CPU)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_plan(EngineConfig(attention_backend="triton"), dense, CPU)
    with pytest.raises(ValueError, match="does not read an FP8 KV cache"):
        resolve_plan(EngineConfig(attention_backend="flashinfer", kv_cache_dtype="fp8_e4m3"), dense, H100)


def test_the_engine_is_built_from_its_plan_and_logs_it_in_one_line(tmp_path, caplog):
    from shared.engine.engine import Engine
    model_dir = build_model_dir(tmp_path / "m", "qwen3_tied_gqa4")
    with caplog.at_level(logging.INFO, logger="duet.engine"):
        eng = Engine(model_dir=str(model_dir), device="cpu", kv_cache_memory=1 << 22, overlap_schedule=False,
                     max_num_batched_tokens=64)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine plan: ")]
    assert lines == [f"engine plan: {eng.plan.render()}"]
    assert "overlap=off" in lines[0] and "step_tokens=64" in lines[0]
    assert eng.overlap is None and eng.scheduler.max_batched_tokens == 64 and eng.runner.graphs is None
    assert eng.plan.overlap.why == "--no-overlap-schedule"


def _duet_env(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUET_") or k == "DUET_CACHE_DIR"}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "services.cli", "env", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


def test_duet_env_prints_the_plan(tmp_path):
    out = _duet_env("--plan")  # the embedded default model, this (CPU-only) machine
    assert out.returncode == 0, out.stderr
    assert "overlap           on" in out.stdout and "the CPU: torch ops" in out.stdout
    assert out.stdout.strip().endswith(plan_for(EngineConfig(device="cpu")).render())
    model_dir = _config_dir(tmp_path, "qwen2_moe_shared")
    got = json.loads(_duet_env("--plan", "--json", "--model", str(model_dir), "--max-model-len", "128",
                               "--pdl-prefetch-at", "o_proj=2").stdout)
    assert list(got) == CHOICES and got["max_model_len"] == {"value": "128", "why": "--max-model-len"}
    bad = _duet_env("--plan", "--model", str(model_dir), "--attention-backend", "triton")
    assert bad.returncode == 1 and "the triton attention backend needs a CUDA device" in bad.stderr
    bad = _duet_env("--plan", "--small-batch-linear", "on")
    assert bad.returncode == 2 and "argument --small-batch-linear: invalid choice: 'on'" in bad.stderr
