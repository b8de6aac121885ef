"""decode_attention: Triton (native on CUDA, interpreted in a child process on
CPU) against the torch reference, and the reference against a float64 naive
formulation that reads the pool slot by slot."""

import math

import pytest
import torch

from kernels.decode_attention import decode_attention_reference
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import ATTENTION_TOLERANCE, case_generator, kernel_dtypes
from tests.helpers.random_paged_kv import random_paged_kv

TARGET = "kernels.decode_attention:decode_attention"
CUDA = torch.cuda.is_available()


def naive_decode(q, pool, layer, page_table, seq_lens, sm_scale):
    """float64, explicit slot arithmetic, one (sequence, head) at a time."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = pool.shape[1], pool.shape[4]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        for h in range(num_q_heads):
            keys, vals = [], []
            for pos in range(n):
                page = int(page_table[b, pos // page_size])
                keys.append(pool[page, h // group, layer, 0, pos % page_size].double())
                vals.append(pool[page, h // group, layer, 1, pos % page_size].double())
            if not keys:
                continue
            scores = torch.stack(keys) @ q[b, h].double() * sm_scale
            weights = torch.exp(scores - scores.max())
            out[b, h] = (weights[:, None] * torch.stack(vals)).sum(0) / weights.sum()
    return out


CASES = [
    # (seq_lens, H_q, H_kv, head_dim, page_size)
    ([7, 33, 1], 4, 4, 64, 1),  # MHA (ratio 1), page 1
    ([50, 130, 17], 8, 2, 128, 16),  # GQA ratio 4
    ([200, 64, 65], 16, 2, 64, 64),  # GQA ratio 8, page 64
    ([0, 40, 0], 8, 1, 64, 16),  # padded batch slots (seq_len 0) give zeros
    ([19, 5], 4, 2, 64, 3),  # page size need not be a power of two
]


@pytest.mark.parametrize("seq_lens,h_q,h_kv,head_dim,page_size", CASES)
def test_reference_matches_naive_float64(seq_lens, h_q, h_kv, head_dim, page_size):
    g = case_generator(seq_lens, h_q, h_kv, head_dim, page_size)
    kv = random_paged_kv(seq_lens, h_kv, head_dim, page_size, torch.float64, torch.device("cpu"), g)
    q = torch.randn(len(seq_lens), h_q, head_dim, generator=g, dtype=torch.float64)
    scale = 1 / math.sqrt(head_dim)
    ref = decode_attention_reference(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale)
    naive = naive_decode(q, kv.pool, kv.layer, kv.page_table, kv.seq_lens, scale)
    assert relative_error(ref, naive) < 1e-10


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("seq_lens,h_q,h_kv,head_dim,page_size", CASES)
def test_triton_matches_reference(runner, dtype, seq_lens, h_q, h_kv, head_dim, page_size):
    g = case_generator(seq_lens, h_q, head_dim, dtype)
    kv = random_paged_kv(seq_lens, h_kv, head_dim, page_size, dtype, runner.device, g)
    q = torch.randn(len(seq_lens), h_q, head_dim, generator=g).to(runner.device, dtype)
    scale = 1 / math.sqrt(head_dim)
    out = fill_nan_(torch.empty_like(q))
    runner(TARGET, q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale, out=out)
    assert torch.isfinite(out).all(), "some output elements were not written"
    ref = decode_attention_reference(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale)
    assert relative_error(out, ref) < ATTENTION_TOLERANCE[dtype]
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert (out[b] == 0).all()


@pytest.mark.parametrize("num_kv_splits", [None, 1, 3, 8])
def test_long_context_splits_agree(runner, num_kv_splits):
    """Several splits per sequence (ragged lengths, some splits empty)."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    seq_lens = [900, 333, 64] if not CUDA else [4000, 1333, 64, 1]
    g = torch.Generator().manual_seed(7 + (num_kv_splits or 0))
    kv = random_paged_kv(seq_lens, 2, 64, 16, dtype, runner.device, g)
    q = torch.randn(len(seq_lens), 8, 64, generator=g).to(runner.device, dtype)
    out = fill_nan_(torch.empty_like(q))
    runner(TARGET, q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.125,
           num_kv_splits=num_kv_splits, out=out)
    ref = decode_attention_reference(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.125)
    assert relative_error(out, ref) < ATTENTION_TOLERANCE[dtype]


@pytest.mark.skipif(CUDA, reason="covered by the dtype sweep on CUDA")
def test_half_precision_in_interpreter(runner):
    """fp16 through the interpreter exercises the p -> v.dtype cast (its tl.dot
    is wrong for bf16, numpy having no bf16, so bf16 is checked on CUDA only)."""
    g = torch.Generator().manual_seed(21)
    kv = random_paged_kv([70, 3], 2, 64, 16, torch.float16, runner.device, g)
    q = torch.randn(2, 8, 64, generator=g).half()
    out = runner(TARGET, q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.125, num_kv_splits=2)
    ref = decode_attention_reference(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.125)
    assert relative_error(out, ref) < 5e-3


def test_auto_split_count_follows_batch_and_capacity():
    from kernels.triton_decode_attention import choose_num_kv_splits

    assert choose_num_kv_splits(batch=1, kv_programs_per_seq=8, kv_capacity=32768, num_sms=132) > 8
    assert choose_num_kv_splits(batch=128, kv_programs_per_seq=8, kv_capacity=32768, num_sms=132) == 1
    # a short page table never gets splits shorter than the minimum
    assert choose_num_kv_splits(batch=1, kv_programs_per_seq=1, kv_capacity=128, num_sms=132) == 1
    # FP8 pages ask for ~8 programs an SM: B=16 of Qwen3-8B (8 kv heads) at 16k gets 9 splits, not 3
    assert choose_num_kv_splits(batch=16, kv_programs_per_seq=8, kv_capacity=16384, num_sms=132) == 3
    assert choose_num_kv_splits(batch=16, kv_programs_per_seq=8, kv_capacity=16384, num_sms=132,
                                programs_per_sm=8) == 9


def test_default_tiling_follows_page_dtype_and_capacity():
    from kernels.triton_decode_attention import DecodeConfig, default_config

    assert default_config(4096, fp8_pages=False) == DecodeConfig()  # swept at 1k context
    assert default_config(16384, fp8_pages=False).num_stages == 3  # long tables: one more stage in flight
    assert default_config(1024, fp8_pages=True).block_n == 128  # FP8 pages: longer steps


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_follows_new_seq_lens():
    g = torch.Generator().manual_seed(11)
    seq_lens = [300, 64, 1000, 64]  # pages are allocated for these; replays stay within them
    kv = random_paged_kv(seq_lens, 2, 128, 16, torch.bfloat16, torch.device("cuda"), g)
    q = torch.randn(4, 8, 128, generator=g).cuda().bfloat16()
    out = torch.empty_like(q)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.1)
    from kernels.decode_attention import decode_attention

    decode_attention(*args, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args, out=out)
    for lens in ([300, 5, 1000, 0], [1, 1, 1, 1], [299, 16, 17, 64]):
        kv.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(4, 8, 128, generator=g).bfloat16())
        fill_nan_(out)
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_attention_reference(*args)
        assert relative_error(out, ref) < 1e-2, lens


@pytest.mark.skipif(not CUDA, reason="needs > 4 GiB of device memory")
def test_page_offsets_beyond_int32():
    """Pages whose element offset exceeds 2**31 (large pools) are addressed right."""
    from kernels.decode_attention import decode_attention

    page_elems = 2 * 8 * 16 * 128
    num_pages = (2**31) // page_elems + 2048
    pool = torch.empty((num_pages, 8, 1, 2, 16, 128), dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    high = torch.arange(num_pages - 64, num_pages, device="cuda", dtype=torch.int32)
    pool[high.long()] = torch.randn((64, 8, 1, 2, 16, 128), generator=g, device="cuda").bfloat16()
    page_table = high.view(2, 32).contiguous()
    seq_lens = torch.tensor([512, 77], dtype=torch.int32, device="cuda")
    q = torch.randn((2, 32, 128), generator=g, device="cuda").bfloat16()
    k_cache, v_cache = pool[:, :, 0, 0], pool[:, :, 0, 1]
    out = decode_attention(q, k_cache, v_cache, page_table, seq_lens, 0.088)
    ref = decode_attention_reference(q, k_cache, v_cache, page_table, seq_lens, 0.088)
    assert relative_error(out, ref) < 1e-2


def test_single_split_writes_output_directly(runner):
    """One split: stage 1 writes o and stage 2 is skipped. Same result as the two-stage
    path (forced by the config) within rounding, zeros for seq_len 0, every element written."""
    from kernels.triton_decode_attention import DecodeConfig

    target = "kernels.triton_decode_attention:launch_decode_attention"
    dtype = torch.bfloat16 if CUDA else torch.float32
    seq_lens = [70, 0, 1, 129]
    g = torch.Generator().manual_seed(31)
    kv = random_paged_kv(seq_lens, 2, 64, 16, dtype, runner.device, g)
    q = torch.randn(len(seq_lens), 8, 64, generator=g).to(runner.device, dtype)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.125, 1)
    direct, two_stage = fill_nan_(torch.empty_like(q)), fill_nan_(torch.empty_like(q))
    runner(target, *args, direct)
    runner(target, *args, two_stage, DecodeConfig(direct_single_split=False))
    ref = decode_attention_reference(*args[:6])
    assert relative_error(direct, ref) < ATTENTION_TOLERANCE[dtype]
    assert relative_error(direct, two_stage) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert (direct[1] == 0).all()
