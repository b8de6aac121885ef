"""Runs in the kernel runner (tests/helpers/kernel_runner.py: the interpreter child on the
CPU, natively on a GPU): one FP8 checkpoint as the GPU engine runs it (fused layers: FP8
linears and experts through the Triton kernels, the Triton attention backend, optionally an
FP8 KV pool) beside the same checkpoint through the torch layers (FP8 weights through the
kernels' torch references) and dequantized (float32 weights and KV: what transformers runs).
One extend step of two prompts (25 tokens) and one decode step (2 rows); returns relative errors
of the hidden states. decode_gemm: FP8 linears of 2..32 rows take the W8A8 decode GEMM, as the
engine runs them on Hopper (kernels/fp8_decode_gemm.py); off, the W8A16 small-batch kernel."""
from __future__ import annotations

import torch

from tests.helpers.accuracy import relative_error


def check_fp8_model(model_dir: str, device: str, kv_fp8: bool, decode_gemm: bool = True) -> dict:
    import kernels.fp8_decode_gemm as fd

    saved = fd.FP8_DECODE_MAX_M
    fd.FP8_DECODE_MAX_M = saved if decode_gemm else 0
    try:
        return _check(model_dir, device, kv_fp8)
    finally:
        fd.FP8_DECODE_MAX_M = saved


def _check(model_dir: str, device: str, kv_fp8: bool) -> dict:
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
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, cfg.vocab_size, (25,), generator=g).to(dev)
    first = -(-21 // PAGE)  # pages of the 21-token sequence, then the 6-token one's
    tables = [list(range(1, first + 1)), list(range(first + 1, first + 1 + -(-6 // PAGE)))]
    extend = _meta([(0, 20), (0, 5)], tables, False, dev)
    pos = torch.tensor(list(range(20)) + list(range(5)), device=dev)
    decode = _meta([(20, 1), (5, 1)], tables, True, dev)
    runs = {}
    for name, fused, keep, backend_cls, kv in (
            ("fused", True, True, TritonAttentionBackend, kv_fp8),
            ("torch_fp8", False, True, TorchAttentionBackend, kv_fp8),
            ("dequantized", False, False, TorchAttentionBackend, False)):
        model = load_model(cfg, TPContext(), torch.float32, dev, 64, fused=fused, keep_fp8=keep)
        layout = KVLayout(num_pages=tables[1][-1] + 1, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, page_size=PAGE,
                          head_dim=cfg.head_dim, dtype=torch.float8_e4m3fn if kv else torch.float32)
        scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in model.layers] if kv else None
        backend = backend_cls(KVPool(layout, dev, scales))
        h_ext = model(ids, pos, ForwardBatch(backend, extend))
        h_dec = model(ids[:2], torch.tensor([20, 5], device=dev), ForwardBatch(backend, decode))
        runs[name] = (h_ext, h_dec, sum(1 for m in model.modules() if getattr(m, "fp8", None)))
    out = {"fp8_layers": runs["fused"][2]}
    for other in ("torch_fp8", "dequantized"):
        out[f"extend_vs_{other}"] = relative_error(runs["fused"][0], runs[other][0])
        out[f"decode_vs_{other}"] = relative_error(runs["fused"][1], runs[other][1])
    return out
