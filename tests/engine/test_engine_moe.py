"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with a shared expert, Mixtral) give
transformers' greedy tokens, and tensor / expert parallelism give TP=1's.

Random-weight models in float64 (no ties), the CPU path (a loop over the experts a batch
touches), a batch of mixed-length prompts with chunked prefill forced small, page sizes 4
and 16, prefix-cache hits; TP=2 and EP=2 over gloo with a real second process."""
from __future__ import annotations

import json

import pytest
import torch

from shared.engine import LLM
from shared.engine.engine import Engine
from shared.engine.model_config import ModelConfig, ModelLoadError
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import (MOE_CONFIGS, assert_all_pages_free, build_model_dir, hf_greedy, load_hf,
                                 random_prompts, run_engine)

MAX_NEW = 12
LENGTHS = [5, 13, 29, 2, 17, 8]
KV_BYTES = 8 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """kind -> (model folder, prompts, HF greedy references), built once."""
    root = tmp_path_factory.mktemp("moe-models")
    out = {}
    for i, kind in enumerate(MOE_CONFIGS):
        d = build_model_dir(root / kind, kind, seed=20 + i)
        hf = load_hf(d, torch.float64)
        prompts = random_prompts(len(LENGTHS), LENGTHS, seed=200 + i)
        refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
        out[kind] = (d, prompts, refs)
    return out


def test_moe_configs_are_read(moe_models):
    q3 = ModelConfig.from_dir(moe_models["qwen3_moe"][0]).moe
    assert (q3.num_experts, q3.top_k, q3.norm_topk_prob, q3.sparse_layers) == (8, 3, True, (0,))
    q2 = ModelConfig.from_dir(moe_models["qwen2_moe_shared"][0])
    assert q2.moe.shared_expert_intermediate_size == 48 and q2.attention_bias
    assert q2.moe.sparse_layers == (0, 1) and not q2.moe.norm_topk_prob
    mx = ModelConfig.from_dir(moe_models["mixtral"][0]).moe
    assert (mx.num_experts, mx.checkpoint_block, mx.norm_topk_prob) == (4, "block_sparse_moe", True)


@pytest.mark.parametrize("page_size,budget", [(4, 8), (16, 16)])
@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_batched_chunked_greedy_equals_hf(moe_models, kind, page_size, budget):
    d, prompts, refs = moe_models[kind]
    assert all(len(set(r)) >= 4 for r in refs), refs  # references worth comparing
    eng = Engine(model_dir=str(d), dtype="float64", device="cpu", page_size=page_size, max_num_batched_tokens=budget,
                 kv_cache_memory=KV_BYTES)
    got = run_engine(eng, prompts, GREEDY)
    for g, ref, p in zip(got, refs, prompts):
        assert g.token_ids == ref, f"prompt of {len(p)} tokens diverged"
    assert eng.stats.steps > sum(len(p) for p in prompts) // budget  # chunking really happened
    assert_all_pages_free(eng)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_prefix_cache_hits_give_the_same_tokens(moe_models, kind):
    d, _, _ = moe_models[kind]
    hf = load_hf(d, torch.float64)
    shared = random_prompts(1, [37], seed=7)[0]
    prompts = [shared + s for s in random_prompts(3, [1, 14, 27], seed=8)]
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    eng = Engine(model_dir=str(d), dtype="float64", device="cpu", page_size=4, max_num_batched_tokens=16,
                 kv_cache_memory=KV_BYTES)
    run_engine(eng, [shared], SamplingParams(temperature=0.0, max_tokens=1))
    got = run_engine(eng, prompts, GREEDY)
    assert [r.token_ids for r in got] == refs
    assert all(r.num_cached_tokens >= 36 for r in got), [r.num_cached_tokens for r in got]
    assert_all_pages_free(eng)


def test_stacked_expert_tensors_load_like_per_expert_ones(moe_models, tmp_path):
    """transformers v5 keeps experts stacked ([E, 2I, H] gate_up, [E, H, I] down); a
    checkpoint saved in that layout loads into the same model."""
    from safetensors.torch import load_file, save_file
    src, prompts, refs = moe_models["qwen3_moe"]
    tensors = load_file(str(src / "model.safetensors"))
    stacked = {}
    for name in list(tensors):
        if ".mlp.experts.0.gate_proj." in name:
            base = name.split(".mlp.experts.")[0] + ".mlp.experts"
            n = 8
            gate_up = [torch.cat([tensors.pop(f"{base}.{e}.gate_proj.weight"),
                                  tensors.pop(f"{base}.{e}.up_proj.weight")]) for e in range(n)]
            stacked[f"{base}.gate_up_proj"] = torch.stack(gate_up)
            stacked[f"{base}.down_proj"] = torch.stack([tensors.pop(f"{base}.{e}.down_proj.weight")
                                                        for e in range(n)])
    assert stacked
    dst = tmp_path / "stacked"
    dst.mkdir()
    for f in ("config.json", "generation_config.json"):
        (dst / f).write_text((src / f).read_text())
    save_file({**tensors, **stacked}, str(dst / "model.safetensors"))
    eng = Engine(model_dir=str(dst), dtype="float64", device="cpu", kv_cache_memory=KV_BYTES)
    assert [r.token_ids for r in run_engine(eng, prompts[:3], GREEDY)] == refs[:3]


def test_missing_expert_weights_fail_clearly(moe_models, tmp_path):
    from safetensors.torch import load_file, save_file
    src = moe_models["mixtral"][0]
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    dst = tmp_path / "broken"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.experts\.2\.up"):
        Engine(model_dir=str(dst), dtype="float64", device="cpu", kv_cache_memory=KV_BYTES)


def test_unsupported_moe_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"],
                                                      "model_type": "deepseek_v3"}))
    with pytest.raises(ModelLoadError, match=r"DeepseekV3ForCausalLM .*not supported; supported MoE "
                                             r"architectures: Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, "
                                             r"MixtralForCausalLM"):
        ModelConfig.from_dir(tmp_path)


def test_expert_parallel_needs_moe_and_matching_sizes(moe_models, tmp_path):
    dense = build_model_dir(tmp_path / "dense", "llama_tied_gqa2")
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        Engine(model_dir=str(dense), dtype="float64", device="cpu", kv_cache_memory=KV_BYTES, tp_size=2, ep_size=2)
    with pytest.raises(ValueError, match=r"expert-parallel size 2 must be 1 or the tensor-parallel size \(1\)"):
        Engine(model_dir=str(moe_models["mixtral"][0]), dtype="float64", device="cpu", kv_cache_memory=KV_BYTES, ep_size=2)


def test_tp_that_does_not_divide_the_experts_fails_clearly(tmp_path):
    d = build_model_dir(tmp_path / "six", "qwen2_moe_shared", num_key_value_heads=4)  # 6 experts
    with pytest.raises(ValueError, match=r"num_experts \(expert parallel\) \(6\) is not divisible by 4"):
        LLM(str(d), dtype="float64", device="cpu", tp=4, ep_size=4)


@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_tp2_and_ep2_give_tp1_tokens(moe_models, kind):
    """TP=2 slices every expert's intermediate dimension; EP=2 gives each rank half the
    experts whole. Both must give TP=1's tokens (greedy, and seeded sampling)."""
    d, prompts, refs = moe_models[kind]
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW)] * 3 + [
        SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=MAX_NEW, ignore_eos=True)]
    prompts = prompts[:4]
    want = [o.token_ids for o in LLM(str(d), dtype="float64", device="cpu", num_threads=1,
                                     kv_cache_memory=KV_BYTES).generate(prompts, params)]
    assert want[:3] == refs[:3]
    for ep in (1, 2):
        llm = LLM(str(d), dtype="float64", device="cpu", num_threads=1, kv_cache_memory=KV_BYTES,
                  tp=2, ep_size=ep, max_num_batched_tokens=16)
        try:
            got = [o.token_ids for o in llm.generate(prompts, params)]
            assert got == want, f"ep={ep}"
            ranks = [_placement(llm.engine)] + llm.engine._tp_workers.call("tests.engine.test_engine_moe:_placement")
            experts, inter = ranks[0][3], ranks[0][4]
            if ep == 1:  # every expert on both ranks, half of each one's intermediate dimension
                assert [r[:3] for r in ranks] == [(0, experts, inter // 2), (0, experts, inter // 2)]
            else:  # half the experts on each rank, whole
                assert [r[:3] for r in ranks] == [(0, experts // 2, inter), (experts // 2, experts // 2, inter)]
            llm.engine.check_idle()
        finally:
            llm.engine.close()


def _placement(engine):
    """Runs on every rank: which experts and intermediate slice rank holds in its first MoE layer."""
    from shared.engine.models.moe import MoEBlock
    block = next(layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, MoEBlock))
    p = block.place
    return (p.first_expert, p.num_local_experts, p.inter_local, p.num_experts, p.intermediate_size)
