"""extend_attention: Triton (native on CUDA, interpreted in a child process on
CPU) against the torch reference, and the reference against a float64 dense
causal softmax over the gathered KV."""

import math

import pytest
import torch

from kernels.extend_attention import extend_attention_reference
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import ATTENTION_TOLERANCE, case_generator, kernel_dtypes
from tests.helpers.random_paged_kv import random_paged_kv

TARGET = "kernels.extend_attention:extend_attention"
CUDA = torch.cuda.is_available()


def naive_extend(q, pool, layer, page_table, ext_lens, prefix_lens, sm_scale):
    """float64: per sequence, slot-by-slot gather, dense causal mask built from
    absolute positions, softmax over the whole row."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, page_size = pool.shape[1], pool.shape[4]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    t0 = 0
    for b, (ext, prefix) in enumerate(zip(ext_lens, prefix_lens)):
        total = prefix + ext
        slots = [(int(page_table[b, p // page_size]), p % page_size) for p in range(total)]
        k = torch.stack([pool[pg, :, layer, 0, off] for pg, off in slots]).double()  # [L, H_kv, D]
        v = torch.stack([pool[pg, :, layer, 1, off] for pg, off in slots]).double()
        for i in range(ext):
            visible = prefix + i + 1
            for h in range(num_q_heads):
                scores = k[:visible, h // group] @ q[t0 + i, h].double() * sm_scale
                out[t0 + i, h] = torch.softmax(scores, 0) @ v[:visible, h // group]
        t0 += ext
    return out


CPU_CASES = [
    # (extend lens, prefix lens, H_q, H_kv, head_dim, page_size)
    ([5, 40, 1], [0, 0, 0], 4, 4, 64, 1),  # prefill only, MHA, page 1
    ([20, 33, 1], [0, 50, 7], 8, 2, 128, 16),  # mixed prefixes, GQA 4
    ([40, 3], [70, 64], 16, 2, 64, 64),  # GQA 8, page 64
    ([0, 10, 2], [30, 5, 0], 8, 1, 64, 16),  # a sequence with nothing to extend
]
GPU_CASES = [
    ([300, 1, 129, 64], [0, 700, 33, 1024], 32, 8, 128, 16),
    ([257, 500], [1000, 0], 16, 2, 64, 64),
    ([128, 77], [5, 1], 8, 8, 128, 1),
]
CASES = CPU_CASES + (GPU_CASES if CUDA else [])


def _build(case, dtype, device):
    ext_lens, prefix_lens, h_q, h_kv, head_dim, page_size = case
    g = case_generator(case, dtype)
    seq_lens = [e + p for e, p in zip(ext_lens, prefix_lens)]
    kv = random_paged_kv(seq_lens, h_kv, head_dim, page_size, dtype, device, g)
    q = torch.randn(sum(ext_lens), h_q, head_dim, generator=g).to(device, dtype)
    qo_indptr = torch.tensor([0] + torch.tensor(ext_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return kv, q, qo_indptr


@pytest.mark.parametrize("case", CPU_CASES)
def test_reference_matches_naive_float64(case):
    kv, q, qo_indptr = _build(case, torch.float64, torch.device("cpu"))
    scale = 1 / math.sqrt(q.shape[-1])
    ref = extend_attention_reference(q, kv.k_cache, kv.v_cache, kv.page_table, qo_indptr, kv.seq_lens, scale)
    naive = naive_extend(q, kv.pool, kv.layer, kv.page_table, case[0], case[1], scale)
    assert relative_error(ref, naive) < 1e-10


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(runner, dtype, case):
    kv, q, qo_indptr = _build(case, dtype, runner.device)
    scale = 1 / math.sqrt(q.shape[-1])
    out = fill_nan_(torch.empty_like(q))
    runner(TARGET, q, kv.k_cache, kv.v_cache, kv.page_table, qo_indptr, kv.seq_lens, scale, out=out)
    assert torch.isfinite(out).all(), "some output elements were not written"
    ref = extend_attention_reference(q, kv.k_cache, kv.v_cache, kv.page_table, qo_indptr, kv.seq_lens, scale)
    assert relative_error(out, ref) < ATTENTION_TOLERANCE[dtype]


@pytest.mark.skipif(CUDA, reason="covered by the dtype sweep on CUDA")
def test_half_precision_in_interpreter(runner):
    """fp16 through the interpreter (its tl.dot is wrong for bf16; bf16 runs on CUDA)."""
    kv, q, qo_indptr = _build(([20, 7], [9, 0], 8, 2, 64, 16), torch.float16, runner.device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, qo_indptr, kv.seq_lens, 0.125)
    assert relative_error(runner(TARGET, *args), extend_attention_reference(*args)) < 5e-3


def test_given_max_extend_len_matches_derived(runner):
    """The engine passes max_extend_len from the host; same result as deriving it."""
    case = ([9, 17], [3, 0], 8, 2, 64, 16)
    kv, q, qo_indptr = _build(case, torch.float32, runner.device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, qo_indptr, kv.seq_lens, 0.2)
    a = runner(TARGET, *args, max_extend_len=17)
    b = runner(TARGET, *args)
    assert torch.equal(a, b)
    assert relative_error(a, extend_attention_reference(*args)) < 1e-3


def test_extend_of_one_token_equals_decode(runner):
    """A batch of 1-token extends is decode: both kernels agree."""
    case = ([1, 1, 1], [40, 0, 99], 8, 2, 64, 16)
    kv, q, qo_indptr = _build(case, torch.float32, runner.device)
    ext = runner(TARGET, q, kv.k_cache, kv.v_cache, kv.page_table, qo_indptr, kv.seq_lens, 0.125)
    dec = runner("kernels.decode_attention:decode_attention", q, kv.k_cache, kv.v_cache,
                 kv.page_table, kv.seq_lens, 0.125)
    assert relative_error(ext, dec) < 1e-4


def extend_with_work(q, k_cache, v_cache, page_table, qo_indptr, seq_lens, sm_scale, spare_items, out=None):
    """extend_attention over a work list cut where it runs (the kernel's own query blocks), with
    `spare_items` unused items past the last (-1: their programs exit)."""
    from kernels.extend_attention import extend_attention, extend_work_items, work_block_m

    block_m = work_block_m(q.shape[-1], q.dtype, q.device)
    ext = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    items = sum(-(-e // block_m) for e in ext) + spare_items
    work = extend_work_items(qo_indptr, block_m, items)
    return extend_attention(q, k_cache, v_cache, page_table, qo_indptr, seq_lens, sm_scale, out=out, work=work)


# a mixed step: one-token decode rows beside two prompts (one over several query blocks), a
# sequence with nothing to extend; GQA 4
MIXED = ([1, 1, 70, 0, 1, 5, 1], [40, 7, 20, 3, 99, 0, 300], 8, 2, 64, 16)


@pytest.mark.parametrize("spare", [0, 9])
def test_a_work_list_gives_the_grid_launchs_numbers(runner, spare):
    """The work-list launch (what a captured mixed step runs) computes each block as the grid
    launch does: equal outputs, every row written, the reference's numbers."""
    kv, q, qo_indptr = _build(MIXED, torch.float32, runner.device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, qo_indptr, kv.seq_lens, 0.125)
    listed = fill_nan_(torch.empty_like(q))
    runner(f"{__name__}:extend_with_work", *args, spare, out=listed)
    assert torch.isfinite(listed).all(), "some output elements were not written"
    assert torch.equal(listed, runner(TARGET, *args))
    assert relative_error(listed, extend_attention_reference(*args)) < 1e-3


def test_the_work_list_names_each_sequences_blocks_last_first_then_nothing():
    from kernels.extend_attention import extend_work_items

    # extends 3, 0, 67, 1, 129 in blocks of 64: 1, 0, 2, 1, 3 blocks
    qo_indptr = torch.tensor([0, 3, 3, 70, 71, 200], dtype=torch.int32)
    assert extend_work_items(qo_indptr, 64, 10).items.tolist() == [
        [0, 0], [2, 1], [2, 0], [3, 0], [4, 2], [4, 1], [4, 0], [-1, 0], [-1, 0], [-1, 0]]
    nothing = torch.zeros(4, dtype=torch.int32)
    assert extend_work_items(nothing, 64, 2).items.tolist() == [[-1, 0], [-1, 0]]


def test_a_work_list_cut_in_other_blocks_than_the_launchs_is_refused():
    """Blocks of another size would leave query rows unwritten (or written twice) with no error:
    the launch checks the list's block size against its own before it runs."""
    from kernels.extend_attention import extend_attention, extend_work_items, work_block_m

    kv, q, qo_indptr = _build(MIXED, torch.float32, torch.device("cpu"))
    own = work_block_m(q.shape[-1], q.dtype, q.device)
    work = extend_work_items(qo_indptr, 2 * own, 16)
    with pytest.raises(ValueError, match=f"blocks of {2 * own} query rows; this launch runs {own}"):
        extend_attention(q, kv.k_cache, kv.v_cache, kv.page_table, qo_indptr, kv.seq_lens, 0.125, work=work)


def test_a_mixed_steps_leading_decode_rows_are_counted_on_the_device_and_left_out_of_the_work_list():
    from kernels.extend_attention import extend_work_items, leading_decode_rows

    # two decode rows, a 67-token chunk, a one-token chunk after it (extend kernel), nothing
    ext = torch.tensor([1, 1, 67, 1, 0], dtype=torch.int32)
    seq_lens = torch.tensor([40, 7, 90, 3, 1], dtype=torch.int32)
    lead, count = leading_decode_rows(ext, seq_lens, 4)
    assert lead.tolist() == [40, 7, 0, 0] and count.item() == 2
    qo_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(ext, 0, dtype=torch.int32)])
    assert extend_work_items(qo_indptr, 64, 5, skip_seqs=count).items.tolist() == [
        [2, 1], [2, 0], [3, 0], [-1, 0], [-1, 0]]
    none, zero = leading_decode_rows(torch.tensor([5, 1], dtype=torch.int32), seq_lens[:2], 2)
    assert none.tolist() == [0, 0] and zero.item() == 0  # a chunk first: every row to the extend kernel
