"""Every launch path of the `kernels` package, called on empty CPU tensors, for
tests/helpers/triton_lowering.py (which records each Triton launch and lowers it for the GPU;
nothing executes, so the tensors hold no data and only their dtypes, shapes, strides and
alignment matter).

A group per kernels/triton_*.py module that launches something; each calls the public
wrappers the kernel tests call (kernels/*.py, tests/helpers/peer_all_reduce_sim.py,
tests/helpers/fp8_grid_kernel.py) over the variants a GPU meets: bf16, fp16 and fp32 activations,
FP8 weights and FP8 KV caches, the constexpr branches (residual, norm, store, neox, expert
map, split-K, direct single split, ...), programmatic dependent launch (launch_pdl, only
possible on a GPU), and the tile configs a GPU picks (the wrappers pick small tiles on the
CPU: those run too) at the serving models' shapes (Qwen3-8B attention and linears,
Qwen3-30B-A3B experts). Index tensors (ids, page tables, lengths) hold valid values: a few
wrappers read them on the host."""
from __future__ import annotations

import dataclasses

import torch

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = (BF16, FP16, FP32)
FP8 = torch.float8_e4m3fn
CUDA = torch.device("cuda")  # only handed to the config pickers (pure Python): what a GPU gets


def _e(*shape, dtype=FP32):
    return torch.empty(*shape, dtype=dtype)


def _pdl():
    """PDL with one weight tile prefetched (the --pdl-prefetch path; the engine's default is none)."""
    from kernels.pdl import Pdl
    return Pdl(prefetch_k_blocks=1)


def _pdl_rows(rows):
    """PDL on launches of up to `rows` rows (the linears and decode attention signal late past one)."""
    from kernels.pdl import Pdl
    return Pdl(max_rows=rows)


# -- elementwise and norms -------------------------------------------------------------------------
def rms_norm():
    from kernels.rms_norm import rms_norm as run
    for dt in DTYPES:
        for rows, width in ((1, 128), (3, 4096), (2, 1000)):
            x, w = _e(rows, width, dtype=dt), _e(width, dtype=dt)
            for pdl in (None, _pdl()):
                run(x, w, 1e-6, pdl=pdl)
                run(x, w, 1e-6, _e(rows, width, dtype=dt), pdl=pdl)
    from kernels.rms_norm import rms_norm_fp8_rows
    for rows, width, group in ((8, 4096, 128), (32, 4096, 128), (2, 576, 64), (1, 48, 128)):
        x, w = _e(rows, width, dtype=BF16), _e(width, dtype=BF16)
        rms_norm_fp8_rows(x, w, 1e-6, _e(rows, width, dtype=BF16), group)
        rms_norm_fp8_rows(x, w, 1e-6, None, group, pdl=_pdl())


def silu_and_mul():
    from kernels.silu_and_mul import silu_and_mul as run
    for dt in DTYPES:
        for rows, inter in ((1, 64), (5, 1000), (3, 12288)):
            run(_e(rows, 2 * inter, dtype=dt))


def rotary_embedding():
    from kernels.rotary_embedding import rotary_embedding as run
    for dt in DTYPES:
        for h_q, h_kv, d in ((4, 4, 64), (32, 8, 128), (12, 2, 64)):
            for neox in (True, False):
                qkv = _e(3, (h_q + 2 * h_kv) * d, dtype=dt)
                run(torch.zeros(3, dtype=torch.int64), qkv[:, :h_q * d], qkv[:, h_q * d:(h_q + h_kv) * d],
                    _e(4096, d), neox)


def qk_norm_rope():
    from kernels.qk_norm_rope import KVCacheWrite, QKNorm
    from kernels.qk_norm_rope import qk_norm_rope as run
    for dt in DTYPES:
        for h_q, h_kv, d, page in ((32, 8, 128, 16), (12, 2, 64, 3)):
            qkv = _e(5, (h_q + 2 * h_kv) * d, dtype=dt)
            q, k, v = qkv.split([h_q * d, h_kv * d, h_kv * d], dim=-1)
            k, v = k.view(-1, h_kv, d), v.view(-1, h_kv, d)
            norm = QKNorm(_e(d, dtype=dt), _e(d, dtype=dt), 1e-6)
            pos, cache = torch.zeros(5, dtype=torch.int64), _e(4096, d)
            for cache_dt in (dt, FP8):
                pool = _e(12, h_kv, 3, 2, page, d, dtype=cache_dt)
                store = KVCacheWrite(pool[:, :, 1, 0], pool[:, :, 1, 1], v, torch.zeros(5, dtype=torch.int32), 0.5, 2.0)
                run(pos, q, k, cache, True, norm=norm, kv_write=store)
                run(pos, q, k, cache, False, norm=None, kv_write=store)
                one = KVCacheWrite(store.k_cache, store.v_cache, v[:1], store.slot_mapping[:1], 0.5, 2.0)
                run(pos[:1], q[:1], k[:1], cache, True, norm=norm, kv_write=one, pdl=_pdl())
            for neox in (True, False):
                run(pos, q, k, cache, neox, norm=norm, kv_write=None)
            run(pos, q, k, cache, True)


# -- paged KV cache --------------------------------------------------------------------------------
def store_kv():
    from kernels.store_kv import store_kv as run
    for dt in DTYPES:
        for h_kv, d, page in ((2, 64, 1), (8, 128, 16), (3, 96, 16)):
            for cache_dt in (dt, FP8):
                pool = _e(6, h_kv, 2, 2, page, d, dtype=cache_dt)
                k = _e(9, h_kv, d, dtype=dt)
                run(pool[:, :, 1, 0], pool[:, :, 1, 1], k, k, torch.zeros(9, dtype=torch.int32), 0.5, 2.0)


def page_copy():
    from kernels.page_copy import gather_pages, scatter_pages
    for dt in DTYPES + (FP8, torch.uint8):
        for page_shape in ((2, 2, 4, 1, 64), (36, 2, 8, 16, 128)):
            backing = _e(19, *page_shape, dtype=dt)
            pool, ids = backing[1::2], torch.tensor([7, 0, 3, 8])
            staging = gather_pages(pool, ids)
            scatter_pages(pool, ids, staging)


def _paged(seq_lens, h_kv, d, page, dt):
    pages = sum(-(-n // page) for n in seq_lens) + 2
    pool = _e(pages, h_kv, 2, 2, page, d, dtype=dt)
    width = max(-(-n // page) for n in seq_lens) + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    return pool[:, :, 1, 0], pool[:, :, 1, 1], table, torch.tensor(seq_lens, dtype=torch.int32)


def decode_attention():
    from kernels.decode_attention import decode_attention as run
    from kernels.triton_decode_attention import DecodeConfig, launch_decode_attention
    for dt in DTYPES:
        for h_q, h_kv, d, page in ((32, 8, 128, 16), (16, 2, 64, 1)):
            for cache_dt in (dt, FP8):
                kc, vc, table, lens = _paged([50, 130, 17], h_kv, d, page, cache_dt)
                q = _e(3, h_q, d, dtype=dt)
                scales = dict(k_scale=0.5, v_scale=2.0) if cache_dt == FP8 else {}
                for splits in (None, 1, 3):
                    run(q, kc, vc, table, lens, 0.125, num_kv_splits=splits, **scales)
                run(q[:1], kc, vc, table[:1], lens[:1], 0.125, pdl=_pdl(), **scales)
                run(q[:1], kc, vc, table[:1], lens[:1], 0.125, num_kv_splits=4, pdl=_pdl(), **scales)
                # PDL past one row: stage 1 lets the next kernel go after its loop (kernels/pdl.py)
                run(q, kc, vc, table, lens, 0.125, num_kv_splits=2, pdl=_pdl_rows(32), **scales)
                launch_decode_attention(q, kc, vc, table, lens, 0.125, 1, None,
                                        DecodeConfig(direct_single_split=False), **scales)


def extend_attention():
    from kernels.extend_attention import extend_attention as run
    from kernels.extend_attention import extend_work_items
    from kernels.triton_extend_attention import default_extend_config, launch_extend_attention
    for dt in DTYPES:
        for h_q, h_kv, d, page in ((32, 8, 128, 16), (4, 4, 64, 1), (16, 2, 64, 64)):
            for cache_dt in (dt, FP8):
                ext, prefix = [20, 33, 1], [0, 50, 7]
                kc, vc, table, lens = _paged([e + p for e, p in zip(ext, prefix)], h_kv, d, page, cache_dt)
                q = _e(sum(ext), h_q, d, dtype=dt)
                qo = torch.tensor([0, 20, 53, 54], dtype=torch.int32)
                scales = dict(k_scale=0.5, v_scale=2.0) if cache_dt == FP8 else {}
                run(q, kc, vc, table, qo, lens, 0.125, **scales)
                launch_extend_attention(q, kc, vc, table, qo, lens, 0.125, 33,
                                        config=default_extend_config(d, dt, CUDA), **scales)
                # a captured mixed step's launch: the grid over a work list
                cfg = default_extend_config(d, dt, CUDA)
                launch_extend_attention(q, kc, vc, table, qo, lens, 0.125, 0, config=cfg,
                                        work=extend_work_items(qo, cfg.block_m, 8), **scales)


def verify_attention():
    from kernels.verify_attention import verify_attention as run
    for dt in DTYPES:
        for q_len, h_q, h_kv, d, page in ((5, 32, 8, 128, 16), (3, 4, 4, 64, 16), (2, 4, 1, 64, 1)):
            kc, vc, table, lens = _paged([70, 130], h_kv, d, page, dt)
            q = _e(2 * q_len, h_q, d, dtype=dt)
            for splits in (None, 1, 3):
                run(q, kc, vc, table, lens, 0.125, q_len, num_kv_splits=splits)


# -- speculative decoding --------------------------------------------------------------------------
def rejection_sample():
    from kernels.rejection_sample import rejection_sample as run
    for b, k, v in ((6, 4, 300), (3, 1, 2500), (8, 7, 64), (2, 4, 151936)):
        run(_e(b, k + 1, v), _e(b, k, v), torch.zeros(b, k, dtype=torch.int64), torch.ones(b, dtype=torch.int64),
            _e(b, k, dtype=torch.float64), torch.zeros(b, k + 1, dtype=torch.int64))


# -- linears ---------------------------------------------------------------------------------------
def small_batch_linear():
    from kernels.small_batch_linear import SmallBatchWorkspace, small_batch_gate_up_silu, small_batch_linear as run
    from kernels.small_batch_linear_config import SmallBatchConfig, get_config
    from kernels.pdl import Pdl
    ws = SmallBatchWorkspace.create("cpu", max_partial_floats=1 << 20, max_tiles=1 << 12)
    configs = [SmallBatchConfig(16, 32, 3), SmallBatchConfig(32, 64, 1), SmallBatchConfig(16, 64, 2, use_dot=False)]
    for dt in DTYPES:
        for m in (1, 16):  # one row takes the CUDA-core path where the config allows it
            x, w, bias = _e(m, 200, dtype=dt), _e(72, 200, dtype=dt), _e(72, dtype=dt)
            for cfg in configs:
                run(x, w, bias, config=cfg, workspace=ws)
                run(x, w, config=cfg)
                small_batch_gate_up_silu(x, w, config=cfg)
        # what a GPU picks (H100 table, heuristic elsewhere) at Qwen3-8B shapes, with PDL at one row
        for n, k, gate_up in ((6144, 4096, False), (24576, 4096, True), (4096, 12288, False), (2048, 4096, False)):
            w = _e(n, k, dtype=dt)
            call = small_batch_gate_up_silu if gate_up else run
            for m, pdl in ((1, None), (1, Pdl()), (1, Pdl(prefetch_k_blocks=8)), (8, None), (8, _pdl_rows(32))):
                call(_e(m, k, dtype=dt), w, config=get_config(m, n, k, dt.itemsize, 132, gate_up, "H100"),
                     workspace=ws, pdl=pdl)


def _fp8_weight(n, k, block):
    from kernels.fp8 import PER_CHANNEL_GROUP_K, Fp8Weight
    if block is None:  # per-channel
        return Fp8Weight(_e(n, k, dtype=FP8), _e(n, 1), torch.arange(n, dtype=torch.int32), PER_CHANNEL_GROUP_K)
    return Fp8Weight(_e(n, k, dtype=FP8), _e(-(-n // block[0]), -(-k // block[1])),
                     torch.arange(n, dtype=torch.int32) // block[0], block[1])


def fp8_linear():
    from kernels.fp8_linear import gemm_config, per_token_group_quant, small_batch_fp8_linear, w8a8_gemm
    from kernels.small_batch_linear import SmallBatchWorkspace
    from kernels.small_batch_linear_config import SmallBatchConfig
    ws = SmallBatchWorkspace.create("cpu", max_partial_floats=1 << 20, max_tiles=1 << 12)
    configs = [SmallBatchConfig(16, 64, 3), SmallBatchConfig(32, 128, 1), SmallBatchConfig(16, 256, 2, use_dot=False),
               SmallBatchConfig(64, 128, 2, widen_f16=True)]  # fp16 widening (kernels/triton_f16_rows.py)
    for dt in DTYPES:
        for k, group in ((320, 128), (96, 32), (4096, 128)):
            per_token_group_quant(_e(7, k, dtype=dt), group)
        for block in ((32, 128), None):
            w = _fp8_weight(96, 256, block)
            for m in (37, 300, 5000):  # a GPU's three tilings
                per_token_group_quant(_e(m, 256, dtype=dt), 128, m_major=True)  # cuBLAS's scale layout
                xq, xs = _e(m, 256, dtype=FP8), _e(m, 2)
                for bias in (None, _e(96, dtype=dt)):
                    w8a8_gemm(xq, xs, w, bias, dt)  # the CPU's tiles
                    w8a8_gemm(xq, xs, w, bias, dt, config=gemm_config(m, 96, 128, CUDA))
            for m in (1, 16):
                x = _e(m, 256, dtype=dt)
                for cfg in configs:
                    small_batch_fp8_linear(x, w, _e(96, dtype=dt), config=cfg, workspace=ws)
                    small_batch_fp8_linear(x, w, config=cfg, gate_up=True)
            small_batch_fp8_linear(_e(1, 256, dtype=dt), w, workspace=ws, pdl=_pdl())
            small_batch_fp8_linear(_e(1, 256, dtype=dt), w, workspace=ws, pdl=_pdl(), gate_up=True)


def fp8_decode_gemm():
    """The decode GEMM's launch (its wrapper runs only on Hopper or in the interpreter): the
    tilings a GPU picks at 1, 16, 17 and 32 rows for Qwen3-8B's linears, split-K or not, bias,
    gate/up, PDL, block and per-channel scales, 16-bit and fp32 x."""
    import dataclasses

    from kernels.fp8 import ACT_EPS, Fp8Rows
    from kernels.fp8_decode_gemm import decode_config
    from kernels.small_batch_linear import SmallBatchWorkspace
    from kernels.triton_fp8_decode_gemm import launch_fp8_decode_gemm
    ws = SmallBatchWorkspace.create("cpu", max_partial_floats=1 << 24, max_tiles=1 << 12)
    for dt in DTYPES:
        for n, k, gate_up in ((6144, 4096, False), (4096, 12288, False), (24576, 4096, True)):
            w = _fp8_weight(n, k, (128, 128))
            for m in (1, 16, 17, 32):
                cfg = decode_config(m, n, k, 132, gate_up, 128, CUDA)
                out = _e(m, n // 2 if gate_up else n, dtype=dt)
                launch_fp8_decode_gemm(_e(m, k, dtype=dt), w, None, out, cfg, ws, gate_up,
                                       _pdl() if m == 1 else _pdl_rows(32) if m == 16 else None, 128, ACT_EPS)
            for m in (8, 32):  # x quantized by the norm before (kernels.rms_norm.rms_norm_fp8_rows)
                cfg = dataclasses.replace(decode_config(m, n, k, 132, gate_up, 128, CUDA), prequant=True)
                rows = Fp8Rows(_e(m, k, dtype=FP8), _e(m, k // 128), 128)
                launch_fp8_decode_gemm(_e(m, k, dtype=dt), w, None, _e(m, n // 2 if gate_up else n, dtype=dt), cfg,
                                       ws, gate_up, None, 128, ACT_EPS, rows)
        w = _fp8_weight(96, 256, None)
        launch_fp8_decode_gemm(_e(3, 256, dtype=dt), w, _e(96, dtype=dt), _e(3, 96, dtype=dt),
                               decode_config(3, 96, 256, 132, False, 128, CUDA), ws, False, None, 128, ACT_EPS)


# -- mixture of experts ----------------------------------------------------------------------------
def _route(t, e, k):
    return _e(t, k), torch.randint(0, e, (t, k), dtype=torch.int32)


def _emap(e):
    m = torch.full((e,), -1, dtype=torch.int32)
    m[: e // 2] = torch.arange(e // 2, dtype=torch.int32)
    return m


def fused_moe():
    from kernels.fused_moe import fused_moe as run
    from kernels.fused_moe import select_experts
    from kernels.fused_moe_config import get_config
    from kernels.triton_fused_moe import ALIGN_SINGLE_PROGRAM_MAX
    for dt in DTYPES:
        for t, e, k in ((6, 60, 4), (17, 128, 8)):
            logits = _e(t, e, dtype=dt)
            for renorm in (True, False):
                select_experts(logits, k, renorm)
                select_experts(logits, k, renorm, dt)
        many = ALIGN_SINGLE_PROGRAM_MAX // 2 + 7  # pairs past the single-program sort
        for t, e, k, h, i in ((7, 8, 2, 64, 32), (33, 16, 4, 72, 40), (many, 16, 2, 32, 16)):
            w13, w2 = _e(e, 2 * i, h, dtype=dt), _e(e, h, i, dtype=dt)
            weights, ids = _route(t, e, k)
            x = _e(t, h, dtype=dt)
            run(x, w13, w2, weights, ids)
            run(x, w13[: e // 2], w2[: e // 2], weights, ids, expert_map=_emap(e))
        # Qwen3-30B-A3B: the tuned tiles (bf16) and the heuristic's, decode to prefill
        e, k, h, i = 128, 8, 2048, 768
        w13, w2 = _e(e, 2 * i, h, dtype=dt), _e(e, h, i, dtype=dt)
        for t in (1, 32, 1024, 4096):
            weights, ids = _route(t, e, k)
            run(_e(t, h, dtype=dt), w13, w2, weights, ids)
            run(_e(t, h, dtype=dt), w13, w2, weights, ids, config=get_config(t, 64, h, i, k, "other"))


def moe_decode():
    from kernels.moe_decode import DecodeTile, moe_decode as run
    small = DecodeTile(router_block_e=4, router_block_k=32, gate_up_block_n=8, gate_up_block_k=32,
                       down_block_n=16, down_block_k=16)
    tiles = (DecodeTile(), dataclasses.replace(small, router_sort=not DecodeTile().router_sort))
    for dt in DTYPES:
        for t, e, k, h, i in ((3, 60, 4, 72, 40), (2, 128, 8, 2048, 768)):
            x, router = _e(t, h, dtype=dt), _e(e, h, dtype=dt)
            w13, w2 = _e(e, 2 * i, h, dtype=dt), _e(e, h, i, dtype=dt)
            for tile in tiles:
                for renorm, round_to in ((True, None), (False, dt)):
                    run(x, router, w13, w2, k, renorm, round_to, tile=tile)
                run(x, router, w13[: e // 2], w2[: e // 2], k, True, expert_map=_emap(e), tile=tile)
                run(x[:1], router, w13, w2, k, True, tile=tile, pdl=_pdl())


def fp8_moe():
    from kernels.fp8_linear import act_group
    from kernels.fp8_moe import experts_fp8, fp8_moe_config, fused_moe_fp8
    from kernels.moe_decode import DecodeCounters, DecodeTile
    small = DecodeTile(gate_up_block_n=8, gate_up_block_k=64, down_block_n=16, down_block_k=16)
    for dt in DTYPES:
        for t, e, k, h, i, block in ((5, 6, 2, 72, 40, (16, 32)), (4, 4, 2, 64, 32, None),
                                     (4096, 128, 8, 2048, 768, (128, 128))):
            w13, w2 = _fp8_weight(2 * i, h, block), _fp8_weight(h, i, block)
            w13 = dataclasses.replace(w13, q=_e(e, 2 * i, h, dtype=FP8), scale=_e(e, *w13.scale.shape))
            w2 = dataclasses.replace(w2, q=_e(e, h, i, dtype=FP8), scale=_e(e, *w2.scale.shape))
            weights, ids = _route(t, e, k)
            x = _e(t, h, dtype=dt)
            fused_moe_fp8(x, w13, w2, weights, ids)  # the CPU's tiles
            fused_moe_fp8(x, w13, w2, weights, ids, config=fp8_moe_config(t, e, k, act_group(w13), CUDA))
            half = (dataclasses.replace(w, q=w.q[: e // 2], scale=w.scale[: e // 2]) for w in (w13, w2))
            fused_moe_fp8(x, *half, weights, ids, expert_map=_emap(e))
            for tile in (DecodeTile(), small):
                for rows, pdl in ((min(t, 4), None), (1, _pdl())):
                    counters = DecodeCounters.create(rows, e, k, h, i, tile)
                    experts_fp8(x[:rows], w13, w2, weights[:rows], ids[:rows], counters=counters, tile=tile, pdl=pdl)


# -- tensor-parallel all-reduce --------------------------------------------------------------------
def peer_all_reduce():
    from tests.helpers.peer_all_reduce_sim import run_calls, run_tokens
    for dt in DTYPES:
        for world, rank in ((2, 0), (8, 5)):
            for hidden in (200, 4096):
                partials = [[_e(3, hidden, dtype=dt) for _ in range(world)]]
                run_calls(rank, partials, None, None, 1e-6)
                run_calls(rank, partials, _e(3, hidden, dtype=dt), _e(hidden, dtype=dt), 1e-6)
    run_tokens(0, 3, torch.zeros(300, dtype=torch.int64), 17)


def peer_read_all_reduce():
    from tests.helpers.peer_all_reduce_sim import run_read_reduce
    for dt in DTYPES:
        for world, rank in ((2, 1), (8, 0)):
            for hidden in (200, 4096):
                partials = [_e(5, hidden, dtype=dt) for _ in range(world)]
                run_read_reduce(rank, partials, None, None, 1e-6)
                run_read_reduce(rank, partials, _e(5, 2 * hidden, dtype=dt)[:, :hidden], _e(hidden, dtype=dt), 1e-6)


def lora():
    from kernels.lora import lora_expand, lora_shrink
    i32 = torch.int32
    # decode rows, a prefill chunk; Qwen3-8B's q/k/v (4096 -> 4096 + 1024 + 1024), gate/up, down; ranks 8..64
    for dt in DTYPES:
        for rows in (1, 8, 256):
            for k, parts, rank in ((4096, (4096, 1024, 1024), 16), (4096, (12288, 12288), 64), (12288, (4096,), 8)):
                slots = 4
                x = _e(rows, k, dtype=dt)
                a = _e(slots, len(parts), rank, k, dtype=dt)
                b = _e(slots, sum(parts), rank, dtype=dt)
                row_slots = torch.full((rows,), -1, dtype=i32)
                shrunk = lora_shrink(x, a, row_slots)
                starts = [0]
                for n in parts:
                    starts.append(starts[-1] + n)
                lora_expand(shrunk, b, _e(rows, sum(parts), dtype=dt), row_slots, _e(slots), starts)


def fp8_probe():
    from tests.helpers.fp8_grid_kernel import fp8_grid_of
    fp8_grid_of(_e(5000))


# group name: the kernels module whose launches it covers (the fp8_probe group: the tests' own kernel)
GROUPS = {
    "triton_rms_norm": rms_norm,
    "triton_silu_and_mul": silu_and_mul,
    "triton_rotary_embedding": rotary_embedding,
    "triton_qk_norm_rope": qk_norm_rope,
    "triton_store_kv": store_kv,
    "triton_page_copy": page_copy,
    "triton_decode_attention": decode_attention,
    "triton_extend_attention": extend_attention,
    "triton_verify_attention": verify_attention,
    "triton_rejection_sample": rejection_sample,
    "triton_small_batch_linear": small_batch_linear,
    "triton_fp8_gemm": fp8_linear,
    "triton_fp8_decode_gemm": fp8_decode_gemm,
    "triton_fused_moe": fused_moe,
    "triton_moe_decode": moe_decode,
    "triton_fp8_moe": fp8_moe,
    "triton_peer_all_reduce": peer_all_reduce,
    "triton_peer_read_all_reduce": peer_read_all_reduce,
    "triton_lora": lora,
    "fp8_probe": fp8_probe,
}
