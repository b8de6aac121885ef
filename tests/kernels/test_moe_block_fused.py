"""The MoE block's GPU path (Triton routing + fused experts, shared expert with the fused
SwiGLU) against its CPU path (transformers' order of operations) on the same weights:
Qwen3-MoE (renormalised top-k), Qwen2-MoE (shared expert, plain top-k) and Mixtral,
sliced for TP rank 1 of 2 and split for EP rank 1 of 2. Runs the kernels natively on CUDA,
in Triton's interpreter otherwise."""
import pytest
import torch

from shared.engine.moe_config import MoEConfig
from shared.engine.parallel.context import TPContext

CONFIGS = {
    "qwen3": MoEConfig(num_experts=8, top_k=3, intermediate_size=48, norm_topk_prob=True,
                       weights_in_model_dtype=True, sparse_layers=(0,)),
    "qwen2_shared": MoEConfig(num_experts=6, top_k=2, intermediate_size=32, norm_topk_prob=False,
                              weights_in_model_dtype=True, sparse_layers=(0,), shared_expert_intermediate_size=64),
    "mixtral": MoEConfig(num_experts=4, top_k=2, intermediate_size=64, norm_topk_prob=True,
                         weights_in_model_dtype=False, sparse_layers=(0,), checkpoint_block="block_sparse_moe"),
}


def fused_vs_torch(kind: str, tp_rank: int, tp_size: int, expert_parallel: bool, tokens: int) -> float:
    """Runs where the kernels run (see the runner fixture): relative error of the block's
    fused output against its torch output."""
    from tests.helpers.accuracy import relative_error
    from shared.engine.models.moe import MoEBlock

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hidden = 64
    g = torch.Generator().manual_seed(tokens * 31 + tp_rank)
    tp = TPContext(rank=tp_rank, size=tp_size)
    block = MoEBlock(CONFIGS[kind], hidden, tp, torch.float32, fused=True, expert_parallel=expert_parallel)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    block.experts.mark_loaded()
    block = block.to(dev)
    x = torch.randn(tokens, hidden, generator=g).to(dev)
    fused = block(x)
    block.fused = False
    if block.shared_expert is not None:
        block.shared_expert.fused = False
    return relative_error(fused, block(x))


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("tp_size,ep", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("tokens", [2, 7, 70])
def test_fused_block_matches_torch_block(runner, kind, tp_size, ep, tokens):
    """2 tokens: the decode kernels (router + top-k, per-pair experts); 7: router + top-k
    kernel, grouped experts; 70: router GEMM, top-k kernel, grouped experts."""
    from shared.engine.models.moe import EXPERTS_DECODE_MAX_TOKENS, ROUTE_FUSED_MAX_TOKENS
    assert 2 <= EXPERTS_DECODE_MAX_TOKENS < 7 <= ROUTE_FUSED_MAX_TOKENS < 70
    err = runner("tests.kernels.test_moe_block_fused:fused_vs_torch", kind, tp_size - 1, tp_size, ep, tokens)
    assert err < 2e-5, err


def test_single_token(runner):
    assert runner("tests.kernels.test_moe_block_fused:fused_vs_torch", "qwen3", 0, 1, False, 1) < 2e-5
