"""Engine options and model loading: dtype choices, and clear errors for folders, weights,
architectures and settings the engine cannot serve."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import (assert_all_pages_free, build_model_dir, hf_greedy, load_hf,
                                 random_prompts, run_engine)

KIND = "qwen3_tied_gqa4"
KV = 4 << 20


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("opts") / KIND, KIND, seed=51)


def test_auto_dtype_is_float32_on_cpu_and_matches_hf(model_dir):
    # device pinned: on a GPU host "auto" picks cuda, where the auto dtype is bfloat16
    eng = Engine(model_dir=str(model_dir), device="cpu", kv_cache_memory=KV)
    assert eng.device.type == "cpu" and eng.dtype == torch.float32
    assert eng.pool.buffer.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())
    prompts = random_prompts(3, [4, 15, 9], seed=52)
    got = run_engine(eng, prompts, SamplingParams(temperature=0.0, max_tokens=8))
    hf = load_hf(model_dir, torch.float32)
    assert [g.token_ids for g in got] == [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_dtypes_run(model_dir, dtype, torch_dtype):
    eng = Engine(model_dir=str(model_dir), dtype=dtype, kv_cache_memory=KV, page_size=4,
                 max_num_batched_tokens=8)
    assert eng.dtype == torch_dtype and eng.pool.buffer.dtype == torch_dtype
    assert all(p.dtype == torch_dtype for p in eng.model.parameters())
    prompts = random_prompts(3, [4, 15, 9], seed=53)
    got = run_engine(eng, prompts, SamplingParams(temperature=0.7, seed=1, max_tokens=8, ignore_eos=True,
                                                  logprobs=2))
    for g in got:
        assert len(g.token_ids) == 8 and all(0 <= t < 512 for t in g.token_ids)
        assert all(lp is not None and lp <= 0 and lp == lp for lp in g.logprobs)  # finite, not NaN
    assert_all_pages_free(eng)


def test_unknown_dtype_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match=r"dtype='float8' \(--dtype\): choose one of auto, float32, bfloat16, float16"):
        Engine(model_dir=str(model_dir), dtype="float8", kv_cache_memory=KV)


def test_float64_is_for_the_cpu_only(model_dir):
    from shared.engine.config import EngineConfig
    from shared.engine.model_config import ModelConfig
    from shared.engine.plan import DeviceFacts
    from shared.engine.plan_resolve import resolve_plan

    cfg, mc = EngineConfig(dtype="float64"), ModelConfig.from_dir(model_dir)
    assert resolve_plan(cfg, mc, DeviceFacts("cpu")).dtype.value == "float64"
    with pytest.raises(ValueError, match="float64 runs on the CPU only"):  # resolving needs no GPU
        resolve_plan(cfg, mc, DeviceFacts("cuda", 0, "NVIDIA H100 80GB HBM3", (9, 0), triton=True))


def test_unknown_options_and_backends_are_refused(model_dir):
    with pytest.raises(TypeError, match="unknown engine option 'page_sise'"):
        Engine(model_dir=str(model_dir), device="cpu", page_sise=4)
    with pytest.raises(ValueError, match=r"attention_backend='fast' \(--attention-backend\): choose one of"):
        Engine(model_dir=str(model_dir), device="cpu", attention_backend="fast", kv_cache_memory=KV)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(model_dir=str(model_dir), device="cpu", attention_backend="triton", kv_cache_memory=KV)
    with pytest.raises(ValueError, match="fewer than 2 pages"):
        Engine(model_dir=str(model_dir), device="cpu", kv_cache_memory=100)


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        Engine(model_dir=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        Engine(model_dir=str(tmp_path))


def test_missing_weights(model_dir, tmp_path):
    d = tmp_path / "noweights"
    shutil.copytree(model_dir, d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights in"):
        Engine(model_dir=str(d), kv_cache_memory=KV)


def test_missing_shard_and_missing_tensor(tmp_path):
    d = build_model_dir(tmp_path / "sharded", "llama_tied_gqa2", max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (d / victim).unlink()
    with pytest.raises(ValueError, match=f"missing: .*{victim}"):
        Engine(model_dir=str(d), kv_cache_memory=KV)
    # drop the shard from the index too: now the weights it held are missing
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != victim}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lacks weights for"):
        Engine(model_dir=str(d), kv_cache_memory=KV)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)).save_pretrained(d)
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel.*"
                                         r"LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        Engine(model_dir=str(d), kv_cache_memory=KV)


def test_offline_llm_api(model_dir):
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV, page_size=4)
    prompts = random_prompts(3, [5, 11, 2], seed=54)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    hf = load_hf(model_dir, torch.float32)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    assert_all_pages_free(llm.engine)
