"""Programmatic dependent launch (kernels/pdl.py): the switch and its fallbacks everywhere;
on a Hopper GPU, a decode layer's kernel chain and the engine give the same bits with PDL
on as off (a kernel that touched memory before its griddepcontrol.wait would race and
differ between replays)."""
from __future__ import annotations

import gc

import pytest
import torch

from kernels.pdl import MAX_ROWS, Pdl, engine_pdl, launch_options, pdl_for, pdl_late, pdl_supported, pdl_wait_first
from shared.engine.sampling_params import SamplingParams
from tests.helpers.engine_models import build_model_dir, random_prompts, run_engine

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_pdl_settings_and_where_it_is_off():
    with pytest.raises(ValueError, match="prefetch_k_blocks"):
        Pdl(prefetch_k_blocks=-1)
    with pytest.raises(ValueError, match="max_rows"):
        Pdl(max_rows=0)
    on = Pdl(max_rows=2)
    assert pdl_for(on, 1) is on and pdl_for(on, 2) is on and pdl_for(on, 3) is None and pdl_for(None, 1) is None
    assert not pdl_supported("cpu")
    assert launch_options(None) == {} and launch_options(Pdl()) == {"launch_pdl": True}


def test_past_one_row_by_model_and_the_long_kernels_signal_late_to_16_rows():
    """The engine's Pdl takes launches past one row where MAX_ROWS says (FP8 models on one GPU);
    kernels with a main loop signal the next kernel after it from 2 to 16 rows, on entry at one row
    and past 16."""
    assert engine_pdl(1, "16-bit", "dense") == Pdl(prefetch_k_blocks=1, max_rows=1)
    assert engine_pdl(1, "fp8", "moe").max_rows == MAX_ROWS[("fp8", "moe")]
    assert engine_pdl(1, "fp8", "dense", tp_size=2).max_rows == 1
    fp8 = engine_pdl(2, "fp8", "dense")
    assert fp8.max_rows == MAX_ROWS[("fp8", "dense")] == 32 and fp8.prefetch_k_blocks == 2
    assert [rows for rows in range(1, 34) if pdl_late(fp8, rows)] == list(range(2, 17))
    assert not pdl_late(None, 8)
    assert [rows for rows in range(1, 34) if pdl_for(fp8, rows)] == list(range(1, 33))
    with pytest.raises(ValueError, match="late_from_rows"):
        Pdl(late_from_rows=0)


def test_short_kernels_wait_first():
    """The kernels without a main loop wait for the kernel before, then signal the next, at every
    size (where they take PDL at all)."""
    fp8 = engine_pdl(1, "fp8", "dense")
    assert [rows for rows in range(1, 34) if pdl_wait_first(fp8, rows)] == list(range(1, 34))
    assert pdl_wait_first(engine_pdl(1, "16-bit", "dense"), 1)
    assert not pdl_wait_first(None, 8)
    with pytest.raises(ValueError, match="wait_first_from_rows"):
        Pdl(wait_first_from_rows=0)


def test_prefetch_overrides_reach_the_named_linears_only():
    from shared.engine.models.layers import enable_pdl

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj, self.o_proj = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            self.qkv_proj.pdl = self.o_proj.pdl = None

    model = torch.nn.ModuleList([Attn(), Attn()])
    assert enable_pdl(model, Pdl(prefetch_k_blocks=1), {"o_proj": 6}) == 4
    assert all(a.o_proj.pdl == Pdl(prefetch_k_blocks=6) and a.qkv_proj.pdl == Pdl(prefetch_k_blocks=1) for a in model)


def test_engine_pdl_option_on_cpu_falls_back_and_rejects_bad_values(tmp_path):
    from shared.engine.engine import Engine

    model_dir = build_model_dir(tmp_path / "m", "qwen3_headdim32")
    prompts = random_prompts(2, [5, 9])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cpu = dict(model_dir=str(model_dir), device="cpu", kv_cache_memory=1 << 22)
    off = run_engine(Engine(**cpu, pdl="off"), prompts, params)
    eng = Engine(**cpu, pdl="on")
    assert eng.pdl is None  # not a GPU: launched as before
    assert [r.token_ids for r in run_engine(eng, prompts, params)] == [r.token_ids for r in off]
    with pytest.raises(ValueError, match=r"pdl='sometimes' \(--pdl\): choose one of on, off"):
        Engine(**cpu, pdl="sometimes")
    with pytest.raises(ValueError, match=r"pdl_prefetch_at='o_proj' \(--pdl-prefetch-at\): expected name=count"):
        Engine(**cpu, pdl="on", pdl_prefetch_at="o_proj")


def _layer_chain(n_layers: int, pdl, ws, g):
    """A Qwen3-like decode layer at batch 1 (hidden 1024, 8 q / 2 kv heads of 128, ctx ~300):
    add+norm, qkv, q/k-norm+RoPE+store, attention, o, add+norm, gate/up+SwiGLU, down."""
    from kernels.decode_attention import decode_attention
    from kernels.qk_norm_rope import KVCacheWrite, QKNorm, qk_norm_rope
    from tests.helpers.random_paged_kv import random_paged_kv
    from kernels.rms_norm import rms_norm
    from kernels.small_batch_linear import small_batch_gate_up_silu, small_batch_linear

    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, hq, hkv, d, inter = 1024, 8, 2, 128, 2048

    def rnd(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt)

    layers = [dict(qkv=rnd((hq + 2 * hkv) * d, hidden), o=rnd(hidden, hq * d), gu=rnd(2 * inter, hidden),
                   down=rnd(hidden, inter), n1=1 + rnd(hidden), n2=1 + rnd(hidden), qn=1 + rnd(d), kn=1 + rnd(d))
              for _ in range(n_layers)]
    kv = random_paged_kv([300], hkv, d, 16, dt, dev, g)
    kv.pool.nan_to_num_(0.0)
    positions = torch.tensor([299], device=dev)
    slots = torch.tensor([int(kv.page_table[0, 299 // 16]) * 16 + 299 % 16], dtype=torch.int32, device=dev)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(512, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).to(dev, dt)
    x0 = rnd(1, hidden, scale=1.0)

    def run():
        h, residual = x0.clone(), torch.zeros_like(x0)
        for w in layers:
            normed, residual = rms_norm(h, w["n1"], 1e-6, residual, pdl=pdl)
            qkv = small_batch_linear(normed, w["qkv"], workspace=ws, pdl=pdl)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k = q.view(1, hq, d), k.view(1, hkv, d)
            qk_norm_rope(positions, q, k, cos_sin, norm=QKNorm(w["qn"], w["kn"], 1e-6),
                         kv_write=KVCacheWrite(kv.k_cache, kv.v_cache, v.view(1, hkv, d), slots), pdl=pdl)
            o = decode_attention(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, d ** -0.5, pdl=pdl)
            h = small_batch_linear(o.reshape(1, hq * d), w["o"], workspace=ws, pdl=pdl)
            normed, residual = rms_norm(h, w["n2"], 1e-6, residual, pdl=pdl)
            h = small_batch_linear(small_batch_gate_up_silu(normed, w["gu"], workspace=ws, pdl=pdl), w["down"],
                                   workspace=ws, pdl=pdl)
        return h + residual

    return run


@pytest.mark.skipif(not HOPPER, reason="PDL needs a Hopper (sm_90+) GPU; on CPU the fallback test above runs")
def test_decode_layer_chain_is_bit_identical_with_pdl_in_a_cuda_graph():
    from kernels.small_batch_linear import SmallBatchWorkspace

    assert pdl_supported("cuda")
    outs = {}
    for name, pdl in (("off", None), ("on", Pdl(prefetch_k_blocks=2)), ("on, prefetch 0", Pdl(prefetch_k_blocks=0))):
        run = _layer_chain(6, pdl, SmallBatchWorkspace.create("cuda"), torch.Generator().manual_seed(3))
        run()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        replays = []
        for _ in range(20):
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(r, replays[0]) for r in replays), name  # no race between replays
        assert torch.isfinite(replays[0]).all()
        outs[name] = replays[0]
    assert torch.equal(outs["on"], outs["off"]) and torch.equal(outs["on, prefetch 0"], outs["off"])


@pytest.mark.skipif(not HOPPER, reason="PDL needs a Hopper (sm_90+) GPU; on CPU the fallback test above runs")
def test_engine_greedy_tokens_identical_with_pdl_on_the_gpu(tmp_path):
    from shared.engine.engine import Engine

    model_dir = build_model_dir(tmp_path / "m", "qwen3_headdim32", dtype=torch.bfloat16, hidden_size=512,
                                intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    prompts = random_prompts(5, [3, 40, 17, 90, 8])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = {}
    for pdl in ("off", "on"):
        eng = Engine(model_dir=str(model_dir), device="cuda", dtype="bfloat16", small_batch_linear="all", pdl=pdl,
                     kv_cache_memory=1 << 28)
        assert (eng.pdl is not None) == (pdl == "on")
        got[pdl] = [r.token_ids for r in run_engine(eng, prompts, params)]
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    assert got["on"] == got["off"]


@pytest.mark.skipif(not HOPPER, reason="PDL needs a Hopper (sm_90+) GPU; on CPU the fallback test above runs")
def test_fp8_engine_greedy_tokens_identical_with_pdl_past_one_row(tmp_path):
    """A dense FP8 model takes PDL on decode launches of up to 32 rows (late signals from 2 to 16,
    attention's K/V prefetch on one row only): batches of 1..6 rows give the tokens PDL off gives."""
    from shared.engine.engine import Engine

    model_dir = build_model_dir(tmp_path / "m", "qwen3_headdim32", dtype=torch.bfloat16, hidden_size=512,
                                intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    prompts = random_prompts(6, [3, 40, 17, 90, 8, 130])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = {}
    for pdl in ("off", "on"):
        eng = Engine(model_dir=str(model_dir), device="cuda", dtype="bfloat16", quantization="fp8", pdl=pdl,
                     kv_cache_memory=1 << 28)
        assert (eng.pdl.max_rows if eng.pdl else None) == (MAX_ROWS[("fp8", "dense")] if pdl == "on" else None)
        got[pdl] = [r.token_ids for r in run_engine(eng, prompts, params)]
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    assert got["on"] == got["off"]


@pytest.mark.skipif(not HOPPER, reason="PDL needs a Hopper (sm_90+) GPU; on CPU the fallback test above runs")
def test_moe_decode_chain_is_bit_identical_with_pdl_and_down_prefetch_in_a_cuda_graph():
    """norm -> route -> experts, eight MoE layers at batch 1 (Qwen3-30B-A3B-like: 64 experts,
    top-8), replayed from a CUDA graph: PDL on the route and experts kernels (two experts-kernel
    tilings) gives the bits of the plain launches."""
    from kernels.moe_decode import DecodeCounters, DecodeTile, experts, route
    from kernels.rms_norm import rms_norm

    g = torch.Generator().manual_seed(5)
    dev, dt = torch.device("cuda"), torch.bfloat16
    e, k, h, i = 64, 8, 1024, 384
    layers = [dict(router=(torch.randn(e, h, generator=g) * 2 / h ** 0.5).to(dev, dt),
                   w13=(torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dev, dt),
                   w2=(torch.randn(e, h, i, generator=g) / i ** 0.5).to(dev, dt),
                   n=(1 + 0.1 * torch.randn(h, generator=g)).to(dev, dt)) for _ in range(8)]
    x0 = torch.randn(1, h, generator=g).to(dev, dt)
    outs = {}
    for name, pdl, tile in (("off", None, DecodeTile()), ("pdl", Pdl(), DecodeTile()),
                            ("pdl, 4 warps", Pdl(), DecodeTile(warps=4)),
                            ("4 warps", None, DecodeTile(warps=4))):
        counters = DecodeCounters.create(1, e, k, h, i, tile, dev)

        def run():
            x, residual = x0.clone(), torch.zeros_like(x0)
            for w in layers:
                normed, residual = rms_norm(x, w["n"], 1e-6, residual, pdl=pdl)
                weights, ids = route(normed, w["router"], k, True, dt, counters=counters, tile=tile, pdl=pdl)
                x = experts(normed, w["w13"], w["w2"], weights, ids, counters=counters, tile=tile, pdl=pdl)
            return x + residual

        run()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        replays = []
        for _ in range(20):
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(r, replays[0]) for r in replays), name
        assert torch.isfinite(replays[0]).all() and replays[0].abs().max() > 0
        assert int(counters.router.count_nonzero()) + int(counters.down.count_nonzero()) == 0, name
        outs[name] = replays[0]
    assert all(torch.equal(o, outs["off"]) for o in outs.values())


@pytest.mark.skipif(not HOPPER, reason="PDL needs a Hopper (sm_90+) GPU; on CPU the fallback test above runs")
def test_moe_engine_greedy_tokens_identical_with_pdl_on_the_gpu(tmp_path):
    from shared.engine.engine import Engine

    model_dir = build_model_dir(tmp_path / "m", "qwen3_moe", dtype=torch.bfloat16)
    prompts = random_prompts(4, [3, 40, 17, 9])
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = {}
    for pdl in ("off", "on"):
        eng = Engine(model_dir=str(model_dir), device="cuda", dtype="bfloat16", pdl=pdl, kv_cache_memory=1 << 28,
                     max_running_requests=1)  # one sequence a step: every decode step takes the batch-1 PDL path
        assert (eng.pdl is not None) == (pdl == "on")
        got[pdl] = [r.token_ids for r in run_engine(eng, prompts, params)]
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    assert got["on"] == got["off"]
