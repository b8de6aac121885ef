"""qk_norm_rope (per-head q/k RMSNorm + rotary + K/V store, one launch): Triton vs the
reference, which is the composition of the rms_norm, rotary_embedding and store_kv
references; and that composition vs the model's own unfused torch layers."""

import pytest
import torch

from kernels.qk_norm_rope import KVCacheWrite, QKNorm, qk_norm_rope_reference
from tests.helpers.accuracy import relative_error
from tests.helpers.kernel_dtypes import ELEMENTWISE_TOLERANCE, case_generator, kernel_dtypes
from tests.kernels.test_kernels_rotary_embedding import cos_sin_cache

TARGET = "kernels.qk_norm_rope:qk_norm_rope"
NUM_PAGES = 12


def _case(tokens, h_q, h_kv, head_dim, page_size, dtype, device, with_norm=True):
    """One qkv buffer (q, k, v are its column slices), norm weights, a random paged cache
    and distinct slots for the tokens, one of them padding (-1) when there are several."""
    g = case_generator(tokens, h_q, h_kv, head_dim, page_size, dtype)
    width = (h_q + 2 * h_kv) * head_dim
    qkv = (torch.randn(tokens, width, generator=g) * 2).to(device, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(device)
    norm = None
    if with_norm:
        norm = QKNorm((1 + 0.2 * torch.randn(head_dim, generator=g)).to(device, dtype),
                      (1 + 0.2 * torch.randn(head_dim, generator=g)).to(device, dtype), 1e-6)
    # the cache is a strided view of a page-major pool, as the engine's is
    pool = torch.randn(NUM_PAGES, h_kv, 3, 2, page_size, head_dim, generator=g).to(device, dtype)
    slots = torch.randperm(NUM_PAGES * page_size, generator=g)[:tokens].to(torch.int32)
    if tokens > 1:
        slots[tokens // 2] = -1
    return qkv, positions, norm, pool, slots.to(device)


def _split(qkv, h_q, h_kv, head_dim):
    q, k, v = qkv.split([h_q * head_dim, h_kv * head_dim, h_kv * head_dim], dim=-1)
    return q, k.view(-1, h_kv, head_dim), v.view(-1, h_kv, head_dim)


def _run_both(runner, qkv, positions, norm, pool, slots, h_q, h_kv, head_dim, is_neox, store):
    """Runs Triton on (qkv, pool) and the reference on clones; returns the reference's."""
    cache = cos_sin_cache(4096, head_dim).to(runner.device)
    qkv_ref, pool_ref = qkv.clone(), pool.clone()
    for buf, pl, call in ((qkv, pool, "triton"), (qkv_ref, pool_ref, "reference")):
        q, k, v = _split(buf, h_q, h_kv, head_dim)
        kv_write = KVCacheWrite(pl[:, :, 1, 0], pl[:, :, 1, 1], v, slots) if store else None
        if call == "triton":
            runner(TARGET, positions, q, k, cache, is_neox, norm=norm, kv_write=kv_write)
        else:
            qk_norm_rope_reference(positions, q, k, cache, is_neox, norm=norm, kv_write=kv_write)
    return qkv_ref, pool_ref


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("tokens,h_q,h_kv,head_dim,page_size", [(1, 4, 4, 64, 16), (9, 32, 8, 128, 16),
                                                                 (5, 12, 2, 64, 3)])
def test_triton_matches_reference(runner, dtype, is_neox, tokens, h_q, h_kv, head_dim, page_size):
    qkv, positions, norm, pool, slots = _case(tokens, h_q, h_kv, head_dim, page_size, dtype, runner.device)
    before = qkv.clone()
    qkv_ref, pool_ref = _run_both(runner, qkv, positions, norm, pool, slots, h_q, h_kv, head_dim, is_neox, True)
    tol = ELEMENTWISE_TOLERANCE[dtype]
    q_cols = slice(0, (h_q + h_kv) * head_dim)
    assert relative_error(qkv[:, q_cols], qkv_ref[:, q_cols]) < tol
    assert relative_error(qkv[:, q_cols], before[:, q_cols]) > 0.1  # q and k did change
    assert torch.equal(qkv[:, q_cols.stop:], before[:, q_cols.stop:])  # v is never modified
    assert relative_error(pool, pool_ref) < tol
    # cells of padding and unused slots, and the other layers, are exactly as they were
    live = slots[slots >= 0].long().cpu()
    untouched = torch.ones(NUM_PAGES * page_size, dtype=torch.bool)
    untouched[live] = False
    flat = pool.cpu().permute(0, 4, 2, 3, 1, 5).reshape(NUM_PAGES * page_size, 3, -1)
    flat_ref = pool_ref.cpu().permute(0, 4, 2, 3, 1, 5).reshape(NUM_PAGES * page_size, 3, -1)
    assert torch.equal(flat[untouched], flat_ref[untouched])
    assert torch.equal(flat[:, [0, 2]], flat_ref[:, [0, 2]])


@pytest.mark.parametrize("with_norm,store", [(False, True), (True, False), (False, False)])
def test_without_norm_or_store(runner, with_norm, store):
    """Llama (no q/k norm) and rotary-only calls; the cache is left alone without a store."""
    h_q, h_kv, d = 8, 2, 64
    qkv, positions, norm, pool, slots = _case(6, h_q, h_kv, d, 4, torch.float32, runner.device, with_norm)
    pool_before = pool.clone()
    qkv_ref, pool_ref = _run_both(runner, qkv, positions, norm, pool, slots, h_q, h_kv, d, True, store)
    assert relative_error(qkv, qkv_ref) < 1e-5
    assert relative_error(pool, pool_ref) < 1e-5
    if not store:
        assert torch.equal(pool, pool_before)


def test_reference_matches_model_layers():
    """The reference (float64) against the model's own torch RMSNorm and rotary layers:
    the fused path computes what the unfused Qwen3 attention computes."""
    from types import SimpleNamespace

    from shared.engine.models.layers import RMSNorm, RotaryEmbedding

    h_q, h_kv, d, t = 4, 2, 64, 7
    qkv, positions, norm, _, _ = _case(t, h_q, h_kv, d, 4, torch.float64, torch.device("cpu"))
    hf_config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    rotary = RotaryEmbedding(hf_config, d, 4096, torch.float64, "cpu")
    q_norm, k_norm = RMSNorm(d, norm.eps, torch.float64), RMSNorm(d, norm.eps, torch.float64)
    q_norm.weight.data.copy_(norm.q_weight)
    k_norm.weight.data.copy_(norm.k_weight)
    q, k, _ = _split(qkv.clone(), h_q, h_kv, d)
    q_model, k_model = rotary(positions, q_norm(q.reshape(t, h_q, d)), k_norm(k))
    q, k, _ = _split(qkv, h_q, h_kv, d)
    qk_norm_rope_reference(positions, q, k, rotary.cos_sin, True, norm=norm)
    # the model's RMSNorm normalises in float32 even for float64 inputs: float32-level agreement
    assert relative_error(q.reshape(t, h_q, d), q_model) < 1e-6
    assert relative_error(k, k_model) < 1e-6


def test_rejects_mismatched_shapes():
    from kernels.qk_norm_rope import qk_norm_rope

    qkv, positions, norm, pool, slots = _case(3, 4, 2, 64, 4, torch.float32, torch.device("cpu"))
    q, k, v = _split(qkv, 4, 2, 64)
    cache = cos_sin_cache(4096, 64)
    with pytest.raises(ValueError, match="norm weights"):
        qk_norm_rope(positions, q, k, cache, norm=QKNorm(norm.q_weight[:32], norm.k_weight, 1e-6))
    with pytest.raises(ValueError, match="v must have"):
        qk_norm_rope(positions, q, k, cache, kv_write=KVCacheWrite(pool[:, :, 0, 0], pool[:, :, 0, 1], v[:2], slots))


def check_fused_model_matches_unfused(model_dir: str, device: str) -> dict:
    """Runs in the kernel runner (interpreter child on CPU). The same checkpoint as a fused
    model over the Triton backend (qk_norm_rope stores K/V, the backend is told kv_stored)
    and as the plain torch model over the torch backend: one extend step (two prompts) and
    one decode step. Returns relative errors of hidden states and of the pools."""
    from shared.engine.attention.torch_backend import TorchAttentionBackend
    from shared.engine.attention.triton_backend import TritonAttentionBackend
    from shared.engine.kv_pool import KVLayout, KVPool
    from shared.engine.model_config import ModelConfig
    from shared.engine.model_runner import ForwardBatch
    from shared.engine.models.loader import load_model
    from shared.engine.parallel.context import TPContext
    from tests.kernels.test_triton_backend import PAGE, _meta

    dev = torch.device(device)
    cfg = ModelConfig.from_dir(model_dir)
    tp = TPContext()
    runs = {}
    for fused, backend_cls in ((True, TritonAttentionBackend), (False, TorchAttentionBackend)):
        model = load_model(cfg, tp, torch.float32, dev, 64, fused=fused)
        layout = KVLayout(num_pages=8, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                          page_size=PAGE, head_dim=cfg.head_dim, dtype=torch.float32)
        pool = KVPool(layout, dev)
        backend = backend_cls(pool)
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(3, cfg.vocab_size, (8,), generator=g).to(dev)
        tables = [[1, 2], [4]]
        extend = _meta([(0, 5), (0, 3)], tables, False, dev)
        pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2], device=dev)
        h_ext = model(ids, pos, ForwardBatch(backend, extend))
        decode = _meta([(5, 1), (3, 1)], tables, True, dev)
        h_dec = model(ids[:2], torch.tensor([5, 3], device=dev), ForwardBatch(backend, decode))
        runs[fused] = (h_ext, h_dec, pool.buffer.clone())
    (fe, fd, fp), (ue, ud, up) = runs[True], runs[False]
    return {"extend": relative_error(fe, ue), "decode": relative_error(fd, ud), "pool": relative_error(fp, up),
            "pool_written": up.abs().sum().item()}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_model_matches_unfused(runner, tmp_path, family):
    from tests.helpers.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / family, family)
    errs = runner("tests.kernels.test_kernels_qk_norm_rope:check_fused_model_matches_unfused", str(model_dir),
                  runner.device.type)
    assert errs["pool_written"] > 0
    for name in ("extend", "decode", "pool"):
        assert errs[name] < 1e-4, (name, errs)
