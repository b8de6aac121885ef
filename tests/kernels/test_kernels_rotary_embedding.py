"""rotary_embedding (in place): Triton vs the torch reference; the reference
vs HF transformers' apply_rotary_pos_emb (neox) and a complex-number
formulation (GPT-J interleaved pairs)."""

import pytest
import torch

from kernels.rotary_embedding import rotary_embedding_reference
from tests.helpers.accuracy import relative_error
from tests.helpers.kernel_dtypes import case_generator, kernel_dtypes

TARGET = "kernels.rotary_embedding:rotary_embedding"
CUDA = torch.cuda.is_available()


def cos_sin_cache(max_pos: int, head_dim: int, base: float = 10000.0, dtype=torch.float32):
    """Llama-style: inv_freq over half the dims; cos half then sin half."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _inputs(tokens, h_q, h_kv, head_dim, dtype, device, max_pos=4096):
    g = case_generator(tokens, h_q, h_kv, head_dim, dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    q = torch.randn(tokens, h_q * head_dim, generator=g).to(device, dtype)
    k = torch.randn(tokens, h_kv * head_dim, generator=g).to(device, dtype)
    return positions.to(device), q, k, cos_sin_cache(max_pos, head_dim).to(device)


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("tokens,h_q,h_kv,head_dim", [(1, 4, 4, 64), (13, 32, 8, 128), (9, 12, 2, 64)])
def test_triton_matches_reference(runner, dtype, is_neox, tokens, h_q, h_kv, head_dim):
    positions, q, k, cache = _inputs(tokens, h_q, h_kv, head_dim, dtype, runner.device)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_reference(positions, q_ref, k_ref, cache, is_neox)
    runner(TARGET, positions, q, k, cache, is_neox)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert relative_error(q, q_ref) < tol and relative_error(k, k_ref) < tol


def test_slices_of_one_qkv_buffer(runner):
    """q and k as column slices of a fused qkv output (token stride > width); v untouched."""
    positions, _, _, cache = _inputs(7, 8, 2, 64, torch.float32, runner.device)
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(7, (8 + 2 + 2) * 64, generator=g).to(runner.device)
    before = qkv.clone()
    q, k = qkv[:, : 8 * 64], qkv[:, 8 * 64: 10 * 64].view(7, 2, 64)
    runner(TARGET, positions, q, k, cache)
    q_ref, k_ref = before[:, : 8 * 64].clone(), before[:, 8 * 64: 10 * 64].clone()
    rotary_embedding_reference(positions, q_ref, k_ref, cache)
    assert relative_error(qkv[:, : 8 * 64], q_ref) < 1e-5
    assert relative_error(qkv[:, 8 * 64: 10 * 64], k_ref) < 1e-5
    assert torch.equal(qkv[:, 10 * 64:], before[:, 10 * 64:])


def test_reference_matches_hf_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    positions, q, k, cache = _inputs(11, 4, 2, 64, torch.float64, torch.device("cpu"))
    cache = cos_sin_cache(4096, 64, dtype=torch.float64)
    # HF layout: [batch, heads, seq, D]; cos/sin [batch, seq, D] duplicated halves
    half_cos, half_sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((half_cos, half_cos), -1)[None], torch.cat((half_sin, half_sin), -1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q.view(1, 11, 4, 64).transpose(1, 2), k.view(1, 11, 2, 64).transpose(1, 2),
                                      cos, sin)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_reference(positions, q_ref, k_ref, cache, is_neox=True)
    assert relative_error(q_ref.view(11, 4, 64), q_hf.transpose(1, 2)[0]) < 1e-12
    assert relative_error(k_ref.view(11, 2, 64), k_hf.transpose(1, 2)[0]) < 1e-12


def test_reference_interleaved_matches_complex_rotation():
    positions, q, k, cache = _inputs(5, 2, 1, 32, torch.float64, torch.device("cpu"))
    cache = cos_sin_cache(4096, 32, dtype=torch.float64)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_reference(positions, q_ref, k_ref, cache, is_neox=False)
    half_cos, half_sin = cache[positions].chunk(2, dim=-1)
    rot = torch.complex(half_cos, half_sin)[:, None, :]  # e^{i * theta}
    qc = torch.view_as_complex(q.view(5, 2, 16, 2).contiguous())
    expected = torch.view_as_real(qc * rot).reshape(5, 64)
    assert relative_error(q_ref, expected) < 1e-12
