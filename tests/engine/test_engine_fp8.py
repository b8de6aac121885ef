"""FP8 checkpoints, online FP8 quantization and the FP8 KV cache in the engine (CPU).

- The default model (SmolLM2-135M) quantized block-wise into the official releases' format
  (128x128 blocks: its 576 and 1536 wide matrices end in partial blocks) gives exactly
  transformers' greedy text on the dequantized weights; `duet generate` serves it (it once
  crashed in the loader). transformers itself refuses partial edge blocks; on a model whose
  sizes divide, its own FP8 loading gives the same tokens too.
- A random Qwen3-MoE, Qwen2-MoE (shared expert) and Llama in every format (block, per-channel,
  per-tensor, compressed-tensors float8) match transformers on the dequantized weights.
- --quantization fp8 turns a 32-bit checkpoint into the same numbers the FP8 release holds.
- Any other quantization method is refused by name, before anything loads.
- The GPU layout (weights kept in FP8) shards over TP ranks with its scales: each rank's FP8
  weights dequantize to exactly that rank's shard of the dequantized model; a rank whose input
  slice starts inside a scale block is refused with the rule.
- The whole GPU path (FP8 linears and experts through the Triton kernels, FP8 KV pages) in
  the Triton interpreter equals its torch reference (tests/helpers/fp8_model_check.py).
- An FP8 KV cache on the CPU: float8 pages (a quarter of fp32's bytes), the checkpoint's
  k_scale / v_scale applied, greedy text close to the float32 cache's.
What only a GPU shows (FP8 tensor-core numerics, speed, CUDA graphs): `duet bench --sections fp8`."""
from __future__ import annotations

import json

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.model_config import ModelConfig, ModelLoadError
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import build_model_dir, hf_greedy, load_hf, random_prompts, run_engine
from tests.helpers.fp8_checkpoints import dequantized_checkpoint, quantize_checkpoint
from tests.helpers.stack import model_dir as default_model_dir

pytestmark = pytest.mark.usefixtures("torch_one_thread")
KV_BYTES = 16 << 20
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def default_fp8(tmp_path_factory):
    """(FP8 folder, dequantized folder, prompts, transformers' greedy tokens) of SmolLM2."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("default-fp8")
    q = quantize_checkpoint(default_model_dir(), root / "fp8", "block", block=(128, 128))
    d = dequantized_checkpoint(q, root / "dequantized")
    tok = AutoTokenizer.from_pretrained(q)
    prompts = [tok(t).input_ids for t in TEXTS]
    hf = load_hf(d, torch.float32)
    refs = [hf_greedy(hf, p, 16) for p in prompts]
    return q, d, prompts, refs, tok


def test_default_model_block_fp8_gives_transformers_greedy_text(default_fp8):
    q, _, prompts, refs, tok = default_fp8
    cfg = json.loads((q / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                   "modules_to_not_convert": ["lm_head"]}
    eng = Engine(model_dir=str(q), device="cpu", kv_cache_memory=KV_BYTES)
    assert eng.weights_description == "float32, dequantized from FP8 block 128x128 (fp8)"
    got = run_engine(eng, prompts, SamplingParams(temperature=0.0, max_tokens=16))
    assert [g.token_ids for g in got] == refs
    assert len(set(refs[0])) >= 6  # real text, not one token repeated
    assert "Paris" in tok.decode(refs[0])


def test_duet_generate_serves_the_fp8_checkpoint(default_fp8, capsys):
    """`duet generate` on an FP8 checkpoint (it once crashed in the loader with a shape error)."""
    from services.offline.generate import main
    q, _, prompts, refs, tok = default_fp8
    assert main(["--model", str(q), "--device", "cpu", "--prompt", TEXTS[0], "--max-tokens", "16"]) == 0
    assert capsys.readouterr().out == tok.decode(refs[0]) + "\n"


@pytest.mark.parametrize("kind,fmt,block", [
    ("qwen3_moe", "block", (16, 32)),  # partial edge blocks on both sides of the experts and q/k/v
    ("qwen2_moe_shared", "block", (32, 32)),
    ("qwen2_moe_shared", "channel", None),
    ("llama_untied_mha_llama3rope", "tensor", None),
    ("qwen3_headdim32", "ct_channel", None),
    ("llama_mqa_linearrope", "ct_tensor", None),
])
def test_fp8_formats_match_transformers_on_dequantized_weights(tmp_path, kind, fmt, block):
    src = build_model_dir(tmp_path / "src", kind, seed=3)
    q = quantize_checkpoint(src, tmp_path / "fp8", fmt, block=block or (128, 128))
    d = dequantized_checkpoint(q, tmp_path / "dequantized")
    hf = load_hf(d, torch.float64)
    prompts = random_prompts(4, [5, 17, 40, 9], seed=7)
    refs = [hf_greedy(hf, p, 12) for p in prompts]
    eng = Engine(model_dir=str(q), device="cpu", dtype="float64", kv_cache_memory=KV_BYTES)
    assert "dequantized from FP8" in eng.weights_description
    got = run_engine(eng, prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [g.token_ids for g in got] == refs


def test_transformers_own_fp8_loading_agrees(tmp_path):
    """Where the sizes divide the blocks (transformers refuses partial ones), transformers'
    own FP8 dequantization of the folder gives the tokens ours does."""
    src = build_model_dir(tmp_path / "src", "qwen3_moe", seed=5)
    q = quantize_checkpoint(src, tmp_path / "fp8", "block", block=(16, 16))
    from transformers import FineGrainedFP8Config
    # dequantized at load, as on a machine without a GPU: with one, transformers would run its
    # own FP8 kernels (which need the `kernels` package) instead of the dequantized weights
    hf = load_hf(q, torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True))
    prompts = random_prompts(3, [6, 20, 11], seed=9)
    refs = [hf_greedy(hf, p, 10) for p in prompts]
    got = run_engine(Engine(model_dir=str(q), device="cpu", kv_cache_memory=KV_BYTES), prompts,
                     SamplingParams(temperature=0.0, max_tokens=10))
    assert [g.token_ids for g in got] == refs


def test_online_quantization_holds_the_numbers_of_the_fp8_release(tmp_path):
    """--quantization fp8 on a 32-bit checkpoint = the block-wise FP8 checkpoint made from it:
    the same tokens and the same logprobs (the same weights, to the bit)."""
    src = build_model_dir(tmp_path / "src", "qwen3_moe", seed=4, hidden_size=128, moe_intermediate_size=64)
    q = quantize_checkpoint(src, tmp_path / "fp8", "block", block=(128, 128))
    prompts = random_prompts(3, [7, 30, 12], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0)
    online = Engine(model_dir=str(src), device="cpu", quantization="fp8", kv_cache_memory=KV_BYTES)
    assert online.weights_description == "float32, dequantized from FP8 block 128x128 (quantized at load)"
    release = Engine(model_dir=str(q), device="cpu", kv_cache_memory=KV_BYTES)
    a, b = run_engine(online, prompts, params), run_engine(release, prompts, params)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    assert [x.logprobs for x in a] == [y.logprobs for y in b]
    plain = run_engine(Engine(model_dir=str(src), device="cpu", kv_cache_memory=KV_BYTES), prompts, params)
    assert [x.logprobs for x in a] != [y.logprobs for y in plain]  # the weights did change
    with pytest.raises(ValueError, match=r"quantization='int8' \(--quantization\): choose one of none, fp8"):
        Engine(model_dir=str(src), device="cpu", quantization="int8")  # refused as the flag refuses it
    with pytest.raises(ModelLoadError, match="--quantization 'int8' is not supported"):
        ModelConfig.from_dir(src, quantization="int8")


@pytest.mark.parametrize("method,qc", [
    ("awq", {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}),
    ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}),
    ("bitsandbytes", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}),
    ("mxfp4", {"quant_method": "mxfp4"}),
    ("compressed-tensors", {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}),
])
def test_other_quantization_methods_are_refused_by_name(tmp_path, method, qc):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 256, "quantization_config": qc}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=f"quantization method '{method}'") as err:
        ModelConfig.from_dir(tmp_path)
    assert "FP8" in str(err.value) and "shape" not in str(err.value)
    with pytest.raises(ModelLoadError, match=method):  # the engine says the same, before any weight loads
        Engine(model_dir=str(tmp_path), device="cpu")


def test_duet_generate_names_a_refused_method(tmp_path, capsys):
    from services.offline.generate import main
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "quantization_config": {
        "quant_method": "awq", "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["--model", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "duet generate: error:" in err and "quantization method 'awq'" in err and "Traceback" not in err


def _rank_models(model_dir, tp_size, rank, ep=False):
    """(FP8-kept model, dequantized model) of one TP rank, loaded without a process group
    (loading shards by rank alone)."""
    from shared.engine.models.loader import load_model
    from shared.engine.parallel.context import TPContext
    cfg = ModelConfig.from_dir(model_dir)
    tp = TPContext(rank=rank, size=tp_size)
    kept = load_model(cfg, tp, torch.float32, torch.device("cpu"), 64, keep_fp8=True, expert_parallel=ep)
    dense = load_model(cfg, tp, torch.float32, torch.device("cpu"), 64, keep_fp8=False, expert_parallel=ep)
    return kept, dense


@pytest.mark.parametrize("kind,fmt,block,tp,ep", [
    ("qwen3_moe", "block", (24, 16), 2, False),  # row blocks of 24 over shards of 16/32 rows: shards inside blocks
    ("qwen3_moe", "block", (24, 16), 4, True),  # experts whole (EP), KV heads replicated over ranks
    ("llama_mqa_linearrope", "block", (48, 32), 2, False),  # one KV head on both ranks
    ("qwen2_moe_shared", "channel", None, 2, False),
    ("qwen3_headdim32", "ct_tensor", None, 2, False),  # per-tensor q/k/v scales stacked per row
])
def test_fp8_weights_shard_over_tp_ranks_with_their_scales(tmp_path, kind, fmt, block, tp, ep):
    from shared.engine.quantization.fp8_params import fp8_weight
    src = build_model_dir(tmp_path / "src", kind, seed=1, num_attention_heads=4)
    q = quantize_checkpoint(src, tmp_path / "fp8", fmt, block=block or (128, 128))
    for rank in range(tp):
        kept, dense = _rank_models(q, tp, rank, ep)
        dense_modules = dict(dense.named_modules())
        fp8_layers = 0
        for name, m in kept.named_modules():
            for attr in (getattr(m, "fp8", None) or {}):
                w = fp8_weight(m, attr)
                assert w.q.dtype == torch.float8_e4m3fn
                assert torch.equal(w.dequantize(), getattr(dense_modules[name], attr)), (name, attr, rank)
                fp8_layers += 1
        assert fp8_layers >= 2 * kept.cfg.num_layers
        # the rest (norms, embeddings, routers, the LM head) stays as the dense model has it
        for name, p in kept.named_parameters():
            if p.dtype != torch.float8_e4m3fn and not name.endswith("_scale"):
                assert torch.equal(p, dict(dense.named_parameters())[name]), name


def test_a_rank_slice_inside_a_scale_block_is_refused(tmp_path):
    from tests.helpers.tiny_models import make_tiny_model
    src = make_tiny_model(tmp_path / "src", "qwen3", hidden=96, heads=6, kv_heads=6, head_dim=16, intermediate=96)
    q = quantize_checkpoint(src, tmp_path / "fp8", "block", block=(32, 32))
    # tp 2: o_proj's and down_proj's 96 inputs split 48 + 48; 48 is inside the second 32-column
    # block (every rank refuses, rank 0 too, whose own slice would start at 0)
    for rank in (0, 1):
        with pytest.raises(ModelLoadError, match=r"layers\.0\.(mlp\.down|self_attn\.o)_proj: each tensor-parallel "
                                                 r"rank holds 48 of its input columns, not a multiple of the "
                                                 r"32-column FP8 scale blocks"):
            _rank_models(q, 2, rank)
    _rank_models(q, 3, 2)  # 32 + 32 + 32: every slice starts a block


@pytest.mark.parametrize("kind,fmt,kv_fp8", [("tiny", "block", True), ("qwen3_moe", "block", True),
                                             ("qwen2_moe_shared", "channel", False)])
def test_gpu_path_in_the_interpreter_equals_its_reference(runner, tmp_path, kind, fmt, kv_fp8):
    """FP8 linears (W8A16 small-batch kernel, W8A8 decode GEMM), FP8 experts (per-pair decode
    kernel and grouped GEMMs) and FP8 KV pages through the Triton kernels = the torch layers over
    FP8 weights; and near the dequantized model (activations and KV quantized to FP8 cost a few
    percent). Where the decode GEMM quantizes activations, two paths whose other kernels differ
    in the last bits (attention, experts, norms: ~1e-7) can round an activation to neighbouring
    FP8 values, a jump of one FP8 step in one value: equal to 1e-4 with the W8A16 kernel, within
    a few percent with the decode GEMM (the decode GEMM equals its reference to the bit:
    tests/kernels/test_kernels_fp8_decode_gemm.py)."""
    from tests.helpers.tiny_models import make_tiny_model
    src = make_tiny_model(tmp_path / "src", "qwen3") if kind == "tiny" else build_model_dir(tmp_path / "src", kind)
    q = quantize_checkpoint(src, tmp_path / "fp8", fmt, block=(32, 32), kv_scales=True)
    check = "tests.helpers.fp8_model_check:check_fp8_model"
    # both routes on the MoE + FP8 KV model; the decode GEMM's on the others (CI time)
    routes = ((False, 1e-2 if runner.use_cuda else 1e-4), (True, 5e-2)) if kind == "qwen3_moe" else ((True, 5e-2),)
    for decode_gemm, tol in routes:
        errs = runner(check, str(q), runner.device.type, kv_fp8, decode_gemm)
        assert errs["fp8_layers"] >= 7
        for step in ("extend", "decode"):  # a GPU's FP8 tensor-core dots add in reduced precision
            assert errs[f"{step}_vs_torch_fp8"] < tol, (decode_gemm, errs)
            assert errs[f"{step}_vs_dequantized"] < 0.3, (decode_gemm, errs)


def test_fp8_kv_cache_on_cpu(default_fp8, tmp_path):
    """float8 pages with the checkpoint's scales; the text stays close to a float32 cache's."""
    q, _, prompts, refs, tok = default_fp8
    scaled = quantize_checkpoint(default_model_dir(), tmp_path / "kv", "block", kv_scales=True)
    eng = Engine(model_dir=str(scaled), device="cpu", kv_cache_memory=KV_BYTES, kv_cache_dtype="fp8_e4m3")
    assert eng.pool.buffer.dtype == torch.float8_e4m3fn
    assert eng.layout.bytes_per_token * 4 == Engine(model_dir=str(q), device="cpu",
                                                    kv_cache_memory=KV_BYTES).layout.bytes_per_token
    k0, v0 = eng.pool.kv_scales(0)
    layer0 = eng.model.layers[0].self_attn
    assert (k0, v0) == (layer0.k_scale, layer0.v_scale) and k0 != 1.0  # read from the checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)
    got = run_engine(eng, prompts, params)
    ref = run_engine(Engine(model_dir=str(scaled), device="cpu", kv_cache_memory=KV_BYTES), prompts, params)
    same = sum(a == b for g, r in zip(got, ref) for a, b in zip(g.token_ids, r.token_ids))
    assert same >= 0.75 * sum(len(r.token_ids) for r in ref)
    first = [abs(g.logprobs[0] - r.logprobs[0]) for g, r in zip(got, ref)]  # the same context: prompt only
    assert max(first) < 0.25, first
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(model_dir=str(q), device="cpu", kv_cache_dtype="int8")



def test_fp8_checkpoint_and_fp8_kv_over_two_tp_processes(tmp_path):
    """Real TP=2 (rank 1 a separate process, gloo): an FP8 MoE checkpoint with KV scales and an
    FP8 KV cache gives TP=1's greedy tokens; each rank's pool is float8 with the same scales."""
    from shared.engine import LLM
    src = build_model_dir(tmp_path / "src", "qwen3_moe", seed=6, num_attention_heads=4)
    q = quantize_checkpoint(src, tmp_path / "fp8", "block", block=(16, 16), kv_scales=True)
    prompts = random_prompts(3, [9, 30, 14], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    common = dict(dtype="float64", device="cpu", num_threads=1, kv_cache_memory=KV_BYTES, kv_cache_dtype="fp8_e4m3")
    want = [o.token_ids for o in LLM(str(q), **common).generate(prompts, params)]
    llm = LLM(str(q), tp=2, **common)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        eng = llm.engine
        theirs = eng.call_followers("tests.engine.test_engine_fp8:_pool_view")
        assert theirs == [_pool_view(eng)] and _pool_view(eng)[0] == "torch.float8_e4m3fn"
    finally:
        llm.engine.close()


def _pool_view(engine):
    """Runs on every rank: the pool's dtype and scales."""
    return str(engine.pool.buffer.dtype), engine.pool.scales
