"""Folded add+RMSNorm (models/layers.py norm_folded_linear, kernels/small_batch_linear.py
FoldedNorm): the engine option and where it is off; on a GPU, the engine with the norms
folded into the decode GEMVs launches no norm kernel inside a layer and generates what the
unfolded engine does. The kernel itself is tested against its references in
tests/test_kernels_small_batch_linear.py (interpreted on CPU, natively on a GPU)."""
from __future__ import annotations

import gc

import pytest
import torch

from shared.engine.sampling_params import SamplingParams
from tests.engine_models import build_model_dir, random_prompts, run_engine

CUDA = torch.cuda.is_available()


def test_option_is_validated_and_off_where_it_cannot_apply(tmp_path):
    from shared.engine.engine import Engine

    model_dir = build_model_dir(tmp_path / "m", "qwen3_headdim32")
    cpu = dict(model_dir=str(model_dir), device="cpu", kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="fold_norms must be auto, all or off"):
        Engine(**cpu, fold_norms="sometimes")
    eng = Engine(**cpu, fold_norms="all")
    assert eng.fold_norms == "off"  # no small-batch kernel on the CPU: nothing to fold into
    assert not any(layer.fold_norms for layer in eng.model.layers)


def _gpu_model(tmp_path):
    return build_model_dir(tmp_path / "m", "qwen3_headdim32", dtype=torch.bfloat16, hidden_size=512,
                           intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128)


def _kernel_launches(eng, prompt, params) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_engine(eng, [prompt], params)
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            counts[ev.name] = counts.get(ev.name, 0) + 1
    return counts


@pytest.mark.skipif(not CUDA, reason="the folded kernel runs in the engine on a GPU; on CPU the kernel "
                                     "tests run it interpreted and the option test above runs")
def test_folded_engine_drops_the_norm_launches_and_generates_the_same_tokens(tmp_path):
    from shared.engine.engine import Engine

    model_dir = _gpu_model(tmp_path)
    # one request at a time, prompts of <= 16 tokens: prefill and decode both run at decode sizes
    prompts = random_prompts(4, [3, 16, 9, 12], seed=7)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    got, launches = {}, {}
    for mode in ("off", "all"):
        eng = Engine(model_dir=str(model_dir), device="cuda", dtype="bfloat16", small_batch_linear="all",
                     fold_norms=mode, cuda_graph=False, kv_cache_memory=1 << 28)
        assert eng.fold_norms == mode
        got[mode] = [run_engine(eng, [p], params)[0] for p in prompts]
        launches[mode] = _kernel_launches(eng, prompts[0], SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True))
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    layers = 2
    norms = {m: sum(n for name, n in launches[m].items() if "rms_norm" in name) for m in launches}
    # unfolded: 2 per layer + the final norm per step; folded: the final norm only (4 steps)
    assert norms["off"] == 4 * (2 * layers + 1) and norms["all"] == 4
    for off, folded in zip(got["off"], got["all"]):
        assert folded.token_ids == off.token_ids
        # bf16: the folded norm rounds once less; the chosen tokens' logprobs stay close
        assert max(abs(a - b) for a, b in zip(folded.logprobs, off.logprobs)) < 0.05
