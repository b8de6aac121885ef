"""verify_attention (speculative decoding's K + 1 queries a sequence over paged KV):
Triton (native on CUDA, interpreted in a child process on CPU) against the torch
reference, at one split and several (rows that see nothing in a split), with GQA groups
that make the row tile ragged, and against the extend kernel on the same inputs."""

import math

import pytest
import torch

from kernels.verify_attention import verify_attention_reference
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import ATTENTION_TOLERANCE, case_generator, kernel_dtypes
from tests.helpers.random_paged_kv import random_paged_kv

TARGET = "kernels.verify_attention:verify_attention"
CUDA = torch.cuda.is_available()

CPU_CASES = [
    # (seq lens after the step, q_len, H_q, H_kv, head_dim, page_size, splits)
    ([9, 40, 5], 5, 8, 2, 64, 4, 1),  # GQA 4: 20 rows in a 32-row tile
    ([70, 130], 3, 4, 4, 64, 16, 4),  # MHA, several splits: early splits see only some rows
    ([8, 200, 17], 8, 16, 2, 32, 16, 3),  # GQA 8, 64 rows
    ([2, 2], 2, 4, 1, 64, 1, 2),  # the draft model's two-token pass, page 1
]
GPU_CASES = [
    ([1040, 7, 4000, 513], 5, 32, 8, 128, 16, None),
    ([2048] * 8, 8, 16, 8, 128, 16, None),
]
CASES = CPU_CASES + (GPU_CASES if CUDA else [])


def _build(case, dtype, device):
    seq_lens, q_len, h_q, h_kv, head_dim, page_size, _ = case
    g = case_generator(case, dtype)
    kv = random_paged_kv(seq_lens, h_kv, head_dim, page_size, dtype, device, g)
    q = torch.randn(len(seq_lens) * q_len, h_q, head_dim, generator=g).to(device, dtype)
    return kv, q


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(runner, dtype, case):
    kv, q = _build(case, dtype, runner.device)
    q_len, splits = case[1], case[6]
    scale = 1 / math.sqrt(q.shape[-1])
    out = fill_nan_(torch.empty_like(q))
    runner(TARGET, q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale, q_len,
           num_kv_splits=splits, out=out)
    assert torch.isfinite(out).all(), "some output elements were not written"
    ref = verify_attention_reference(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale, q_len)
    assert relative_error(out, ref) < ATTENTION_TOLERANCE[dtype]


def test_same_as_the_extend_kernel(runner):
    case = ([33, 61], 4, 8, 2, 64, 16, 2)
    kv, q = _build(case, torch.float32, runner.device)
    qo = torch.arange(3, dtype=torch.int32, device=runner.device) * 4
    ver = runner(TARGET, q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, 0.125, 4, num_kv_splits=2)
    ext = runner("kernels.extend_attention:extend_attention", q, kv.k_cache, kv.v_cache, kv.page_table, qo,
                 kv.seq_lens, 0.125)
    assert relative_error(ver, ext) < 1e-4
