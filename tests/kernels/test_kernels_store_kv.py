"""store_kv: Triton vs the torch reference (exact: it is a copy) and the
reference vs a token-by-token loop; writes land in the strided layer view only."""

import pytest
import torch

from kernels.store_kv import store_kv_reference
from tests.helpers.kernel_dtypes import case_generator, kernel_dtypes

TARGET = "kernels.store_kv:store_kv"
CUDA = torch.cuda.is_available()


def _case(num_tokens, h_kv, head_dim, page_size, dtype, device, pad_tokens=0):
    g = case_generator(num_tokens, h_kv, head_dim, page_size, dtype)
    num_pages = num_tokens // page_size + 3
    pool = torch.full((num_pages, h_kv, 2, 2, page_size, head_dim), float("nan"), dtype=dtype, device=device)
    slots = torch.randperm(num_pages * page_size, generator=g)[:num_tokens]
    slots[:pad_tokens] = -1  # padding tokens of a CUDA-graph batch
    k = torch.randn(num_tokens, h_kv, head_dim, generator=g).to(device, dtype)
    v = torch.randn(num_tokens, h_kv, head_dim, generator=g).to(device, dtype)
    return pool, k, v, slots.to(device)


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("num_tokens,h_kv,head_dim,page_size,pad", [
    (37, 2, 64, 1, 0), (50, 8, 128, 16, 3), (130, 1, 64, 64, 0), (9, 3, 96, 16, 2),
])
def test_triton_matches_reference(runner, dtype, num_tokens, h_kv, head_dim, page_size, pad):
    pool, k, v, slots = _case(num_tokens, h_kv, head_dim, page_size, dtype, runner.device, pad)
    expected = pool.clone()
    store_kv_reference(expected[:, :, 1, 0], expected[:, :, 1, 1], k, v, slots)
    runner(TARGET, pool[:, :, 1, 0], pool[:, :, 1, 1], k, v, slots)
    torch.testing.assert_close(pool, expected, rtol=0, atol=0, equal_nan=True)
    # every live token landed, and nothing else changed (other layer still all NaN)
    assert torch.isnan(pool[:, :, 0]).all()
    assert int((~torch.isnan(pool[:, 0, 1, 0, :, 0])).sum()) == num_tokens - pad


def test_reference_matches_token_loop():
    pool, k, v, slots = _case(40, 2, 64, 16, torch.float32, torch.device("cpu"), pad_tokens=4)
    ref = pool.clone()
    store_kv_reference(ref[:, :, 0, 0], ref[:, :, 0, 1], k, v, slots)
    naive = pool.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        naive[slot // 16, :, 0, 0, slot % 16] = k[t]
        naive[slot // 16, :, 0, 1, slot % 16] = v[t]
    torch.testing.assert_close(ref, naive, rtol=0, atol=0, equal_nan=True)
    assert int((~torch.isnan(ref[:, 0, 0, 0, :, 0])).sum()) == 36


def test_store_then_decode_reads_what_was_stored(runner):
    """store_kv and decode_attention agree on the slot layout."""
    from kernels.decode_attention import decode_attention_reference

    g = torch.Generator().manual_seed(5)
    page_size, seq_len = 16, 45
    pool = torch.zeros((6, 2, 1, 2, page_size, 64), device=runner.device)
    pages = torch.tensor([4, 1, 3], dtype=torch.int32)
    pos = torch.arange(seq_len)
    slots = (pages.long()[pos // page_size] * page_size + pos % page_size).to(runner.device)
    k = torch.randn(seq_len, 2, 64, generator=g).to(runner.device)
    v = torch.randn(seq_len, 2, 64, generator=g).to(runner.device)
    runner(TARGET, pool[:, :, 0, 0], pool[:, :, 0, 1], k, v, slots)
    q = torch.randn(1, 4, 64, generator=g).to(runner.device)
    got = decode_attention_reference(q, pool[:, :, 0, 0], pool[:, :, 0, 1], pages.view(1, 3).to(runner.device),
                                     torch.tensor([seq_len], dtype=torch.int32, device=runner.device), 0.125)
    scores = torch.einsum("hd,lhd->hl", q[0], k.repeat_interleave(2, 1)) * 0.125
    dense = torch.einsum("hl,lhd->hd", scores.softmax(-1), v.repeat_interleave(2, 1))
    assert torch.allclose(got[0], dense, atol=1e-5)
