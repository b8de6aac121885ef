"""An FP8 (float8_e4m3fn) KV cache in the attention kernels: store_kv and the fused
q/k-norm + RoPE prologue write k / k_scale and v / v_scale bit for bit as the reference
(saturation and round-to-nearest-even included); decode and extend attention read FP8 pages
with the scales as their references do, and land near attention over the unquantized K/V.
Interpreter on the CPU; the device script times FP8 KV at long context."""
import math

import pytest
import torch

from kernels.decode_attention import decode_attention_reference
from kernels.extend_attention import extend_attention_reference
from kernels.fp8 import FP8_DTYPE
from kernels.qk_norm_rope import KVCacheWrite, qk_norm_rope_reference
from kernels.store_kv import store_kv_reference
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import CUDA, case_generator
from tests.helpers.random_paged_kv import random_paged_kv
from tests.kernels.test_kernels_rotary_embedding import cos_sin_cache

SCALES = [(1.0, 1.0), (0.37, 2.5)]
TOL = 1e-3 if CUDA else 1e-5  # the GPU's exp2 and dot order (fp32 throughout either way)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_store_kv_writes_fp8_bit_for_bit(runner, k_scale, v_scale):
    g = case_generator("store", k_scale)
    pool = torch.zeros(6, 2, 2, 4, 16, 64, dtype=FP8_DTYPE)
    k = torch.randn(9, 4, 64, generator=g) * 200  # some values past 448 * scale: saturated
    v = torch.randn(9, 4, 64, generator=g)
    slots = torch.randperm(6 * 16, generator=g)[:9].to(torch.int32)
    slots[4] = -1
    ref = pool.clone()
    store_kv_reference(ref[:, 1, 0], ref[:, 1, 1], k, v, slots, k_scale, v_scale)
    dev = runner.device
    got = pool.to(dev)
    runner("kernels.store_kv:store_kv", got[:, 1, 0], got[:, 1, 1], k.to(dev), v.to(dev), slots.to(dev),
           k_scale, v_scale)
    assert torch.equal(bits(got), bits(ref))
    assert (ref[:, 1, 0].float().abs().max() == 448.0)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_fused_prologue_writes_fp8_bit_for_bit(runner, k_scale, v_scale):
    g = case_generator("prologue", k_scale)
    tokens, h_q, h_kv, d = 5, 8, 2, 64
    qkv = torch.randn(tokens, (h_q + 2 * h_kv) * d, generator=g) * 2
    positions = torch.randint(0, 512, (tokens,), generator=g)
    pool = torch.zeros(8, 2, 2, h_kv, 16, d, dtype=FP8_DTYPE)
    slots = torch.randperm(8 * 16, generator=g)[:tokens].to(torch.int32)
    cache = cos_sin_cache(512, d)
    results = []
    for where in ("triton", "reference"):
        buf, pl = qkv.clone().to(runner.device), pool.clone().to(runner.device)
        q, k, v = buf.split([h_q * d, h_kv * d, h_kv * d], dim=-1)
        k, v = k.view(-1, h_kv, d), v.view(-1, h_kv, d)
        kw = KVCacheWrite(pl[:, 1, 0], pl[:, 1, 1], v, slots.to(runner.device), k_scale, v_scale)
        args = (positions.to(runner.device), q, k, cache.to(runner.device), True)
        if where == "triton":
            runner("kernels.qk_norm_rope:qk_norm_rope", *args, kv_write=kw)
        else:
            qk_norm_rope_reference(*args, kv_write=kw)
        results.append((buf.cpu(), pl))
    if runner.device.type == "cpu":
        assert torch.equal(results[0][0], results[1][0])
        assert torch.equal(bits(results[0][1]), bits(results[1][1]))
    else:
        # the GPU contracts the rotation into FMAs: q and k move by a float ulp, which can
        # carry a value across an fp8 rounding boundary (one step at most, rarely)
        torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
        step = (bits(results[0][1]).int() - bits(results[1][1]).int()).abs()
        assert step.max() <= 1 and (step > 0).float().mean() < 0.01, step.nonzero()


def fp8_paged_kv(seq_lens, h_kv, d, page, g, k_scale, v_scale):
    """A random paged pool in fp32 and the FP8 cache the engine would hold for it."""
    kv = random_paged_kv(seq_lens, h_kv, d, page, torch.float32, torch.device("cpu"), g, poison=False)
    fp8 = kv.pool.clone()
    fp8[:, :, :, 0] = fp8[:, :, :, 0] / k_scale
    fp8[:, :, :, 1] = fp8[:, :, :, 1] / v_scale
    kv8 = random_paged_kv(seq_lens, h_kv, d, page, torch.float32, torch.device("cpu"), g, poison=False)
    kv8.pool, kv8.page_table, kv8.seq_lens = fp8.clamp(-448, 448).to(FP8_DTYPE), kv.page_table, kv.seq_lens
    return kv, kv8


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_decode_attention_reads_fp8_pages(runner, k_scale, v_scale):
    g = case_generator("decode", k_scale)
    kv, kv8 = fp8_paged_kv([40, 130, 7], 2, 64, 16, g, k_scale, v_scale)
    q = torch.randn(3, 8, 64, generator=g)
    scale = 1 / math.sqrt(64)
    dev = runner.device
    out = fill_nan_(torch.empty_like(q)).to(dev)
    for splits in (1, 3):
        runner("kernels.decode_attention:decode_attention", q.to(dev), kv8.k_cache.to(dev), kv8.v_cache.to(dev),
               kv8.page_table.to(dev), kv8.seq_lens.to(dev), scale, num_kv_splits=splits, out=out,
               k_scale=k_scale, v_scale=v_scale)
        ref = decode_attention_reference(q, kv8.k_cache, kv8.v_cache, kv8.page_table, kv8.seq_lens, scale,
                                         k_scale, v_scale)
        assert relative_error(out, ref) < TOL
    exact = decode_attention_reference(q, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, scale)
    assert relative_error(out, exact) < 0.05  # e4m3 K and V


@pytest.mark.parametrize("dtype,big,small", [(torch.bfloat16, 1e5, 1e-6), (torch.float16, 1e3, 1e-3)])
def test_decode_attention_fp8_pages_with_16bit_q_of_any_magnitude(runner, dtype, big, small):
    """A 16-bit q reads FP8 pages in fp16 (one conversion per two cached values): each bf16 head
    of q is scaled by a power of two first, so a head far past fp16's range (1e5: a one-hot
    softmax) and a tiny one (1e-6: a flat softmax) give the reference's output, not NaN or the
    wrong weights; an fp16 q goes in as it is. Both with one split (stage 1 writes o) and three
    (stage 2 reduces)."""
    g = case_generator("decode 16-bit q", dtype)
    _, kv8 = fp8_paged_kv([40, 130, 7], 2, 64, 16, g, 0.5, 2.0)
    q = torch.randn(3, 8, 64, generator=g)
    q[1, 2] *= big
    q[0, 5] *= small
    q = q.to(dtype)
    scale = 1 / math.sqrt(64)
    dev = runner.device
    ref = decode_attention_reference(q.float(), kv8.k_cache, kv8.v_cache, kv8.page_table, kv8.seq_lens, scale,
                                     0.5, 2.0)
    for splits in (1, 3):
        out = runner("kernels.decode_attention:decode_attention", q.to(dev), kv8.k_cache.to(dev), kv8.v_cache.to(dev),
                     kv8.page_table.to(dev), kv8.seq_lens.to(dev), scale, num_kv_splits=splits,
                     k_scale=0.5, v_scale=2.0).float().cpu()
        # bf16 output rounding (the interpreter stores bf16 by truncation: up to 2^-8)
        for b, h in ((1, 2), (0, 5), (2, 0)):
            assert relative_error(out[b, h], ref[b, h]) < 1e-2, (splits, b, h)
        assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_extend_attention_reads_fp8_pages(runner, k_scale, v_scale):
    g = case_generator("extend", k_scale)
    ext, prefix = [37, 5], [20, 64]
    kv, kv8 = fp8_paged_kv([e + p for e, p in zip(ext, prefix)], 2, 64, 16, g, k_scale, v_scale)
    q = torch.randn(sum(ext), 4, 64, generator=g)
    qo = torch.tensor([0, ext[0], sum(ext)], dtype=torch.int32)
    dev = runner.device
    got = runner("kernels.extend_attention:extend_attention", q.to(dev), kv8.k_cache.to(dev), kv8.v_cache.to(dev),
                 kv8.page_table.to(dev), qo.to(dev), kv8.seq_lens.to(dev), 0.125, k_scale=k_scale, v_scale=v_scale)
    ref = extend_attention_reference(q, kv8.k_cache, kv8.v_cache, kv8.page_table, qo, kv8.seq_lens, 0.125,
                                     k_scale, v_scale)
    assert relative_error(got, ref) < TOL
    exact = extend_attention_reference(q, kv.k_cache, kv.v_cache, kv.page_table, qo, kv.seq_lens, 0.125)
    assert relative_error(got, exact) < 0.05
