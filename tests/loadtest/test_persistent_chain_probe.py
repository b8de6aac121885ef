"""The persistent-chain probe's kernel (loadtest/bench/persistent_chain_probe.py) computes what
it times: one layer's qkv -> o -> gate/up + SwiGLU -> down chain over block-FP8 weights, each
load structure (a step ahead by hand, Triton's pipeliner, TMA tiles), against the chain in
fp32 on the dequantized weights. One program (the interpreter runs programs one after
another, so it cannot run a grid barrier over several); its three barriers still count."""

import pytest
import torch

TARGET = "loadtest.bench.persistent_chain_probe:one_program_chain"


@pytest.mark.parametrize("ahead", [1, 0, -1])
def test_one_program_chain_matches_the_fp32_chain(runner, ahead):
    from loadtest.bench.persistent_chain_probe import random_layers, reference_layer

    layer = random_layers(1, "cpu", qkv=384, hidden=256, inter=512)[0]
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = reference_layer(x.view(-1), layer)
    if runner.use_cuda:
        layer = {k: type(w)(w.q.cuda(), w.scale.cuda(), w.scale_row.cuda(), w.group_k, w.tile_n)
                 for k, w in layer.items()}
        x = x.cuda()
    got, arrivals = runner(TARGET, layer, x, ahead, 16, 128)
    assert arrivals == 3  # one per phase boundary
    for name in ("qkv", "o", "gu", "d"):
        g, w = got[name].float().cpu(), want[name].float()
        assert not g.isnan().any(), f"{name} was read before it was written"
        # bf16 outputs; each stage rounds its input once more than the fp32 chain's
        assert (g - w).abs().max() <= 0.05 * w.abs().max(), name
