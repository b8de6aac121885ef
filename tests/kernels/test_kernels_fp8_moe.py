"""FP8 experts (kernels/fp8_moe.py) against their torch references: the W8A8 grouped GEMMs of
the prefill path (triton_fp8_moe.py) and the W8A16 one-launch decode experts kernel
(triton_moe_decode.py's FP8 path), with block scales whose edge blocks are partial along
both dimensions (gate and up each on their own block grid, as checkpoints store them), with
per-channel scales, and with an expert map (expert parallel). Interpreter on the CPU (FP8
values exact, products in wider precision); the FP8 tensor-core numerics and speed are
`duet bench --sections fp8`'s."""
import pytest
import torch

from kernels.fp8 import PER_CHANNEL_GROUP_K, Fp8Weight, quantize_block, quantize_channel
from kernels.fp8_moe import fused_moe_fp8_reference
from kernels.fused_moe import select_experts_reference
from kernels.moe_decode import DecodeCounters, DecodeTile
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import CUDA, case_generator

FUSED = "kernels.fp8_moe:fused_moe_fp8"
EXPERTS = "kernels.fp8_moe:experts_fp8"
BLOCK = (16, 32)
W8A8_TOL = 5e-3 if CUDA else 1e-5  # FP8 tensor-core dots add in reduced precision within a K step
# K tiles spanning two 32-column scale groups (gate/up 64; down 64, over a partial last group at
# I = 40 or 48), or inside one (down 16)
TILE = DecodeTile(gate_up_block_n=8, gate_up_block_k=64, down_block_n=16, down_block_k=16)
WIDE_TILE = DecodeTile(gate_up_block_n=8, gate_up_block_k=64, down_block_n=16, down_block_k=64)
NARROW_TILE = DecodeTile(gate_up_block_n=8, gate_up_block_k=16, down_block_n=16, down_block_k=16)


def stack_experts(parts_per_expert: list[list[torch.Tensor]], per_channel: bool) -> Fp8Weight:
    """[E, sum(rows), K] FP8 from each expert's parts ([rows, K] each), every part quantized on
    its own block grid; the scale-row map restarts at each part and is the same for every
    expert."""
    qs, scales, row_map = [], [], None
    for parts in parts_per_expert:
        q_e, s_e, rows, off = [], [], [], 0
        for w in parts:
            if per_channel:
                q, s = quantize_channel(w)
                rows.append(torch.arange(w.shape[0]) + off)
                off += w.shape[0]
            else:
                q, s = quantize_block(w, BLOCK)
                rows.append(torch.arange(w.shape[0]) // BLOCK[0] + off)
                off += s.shape[0]
            q_e.append(q)
            s_e.append(s)
        qs.append(torch.cat(q_e))
        scales.append(torch.cat(s_e))
        row_map = torch.cat(rows).to(torch.int32)
    return Fp8Weight(torch.stack(qs), torch.stack(scales), row_map, PER_CHANNEL_GROUP_K if per_channel else BLOCK[1])


def experts(g, e, h, i, per_channel=False):
    w13 = stack_experts([[torch.randn(i, h, generator=g) / h ** 0.5, torch.randn(i, h, generator=g) / h ** 0.5]
                         for _ in range(e)], per_channel)
    w2 = stack_experts([[torch.randn(h, i, generator=g) / i ** 0.5] for _ in range(e)], per_channel)
    return w13, w2


def to(w: Fp8Weight, dev) -> Fp8Weight:
    return Fp8Weight(w.q.to(dev), w.scale.to(dev), w.scale_row.to(dev), w.group_k)


def nan_padded(w: Fp8Weight, dev) -> Fp8Weight:
    """w on dev with each scale row followed by NaN columns (a wider row stride): a scale read
    past a row's last group poisons the output (0 x NaN)."""
    padded = torch.full((*w.scale.shape[:-1], w.scale.shape[-1] + 2), float("nan"))
    padded[..., :w.scale.shape[-1]] = w.scale
    return Fp8Weight(w.q.to(dev), padded.to(dev)[..., :w.scale.shape[-1]], w.scale_row.to(dev), w.group_k)


def route(g, t, e, k, h):
    x = torch.randn(t, h, generator=g)
    weights, ids = select_experts_reference(torch.randn(t, e, generator=g), k, True)
    return x, weights, ids


@pytest.mark.parametrize("t,e,k,h,i,per_channel", [(5, 6, 2, 72, 40, False), (33, 8, 3, 64, 48, False),
                                                   (4, 4, 2, 64, 32, True)])
def test_fused_moe_fp8_matches_reference(runner, t, e, k, h, i, per_channel):
    g = case_generator("fused", t, e, k, h, i, per_channel)
    w13, w2 = experts(g, e, h, i, per_channel)
    x, weights, ids = route(g, t, e, k, h)
    dev = runner.device
    out = fill_nan_(torch.empty(t, h, device=dev))
    runner(FUSED, x.to(dev), to(w13, dev), to(w2, dev), weights.to(dev), ids.to(dev), out=out)
    want = fused_moe_fp8_reference(x, w13, w2, weights, ids)
    assert relative_error(out, want) < W8A8_TOL
    # near the unquantized experts: FP8 weights and FP8 activations cost a few percent
    from kernels.fused_moe import fused_moe_reference
    exact = fused_moe_reference(x, w13.dequantize(), w2.dequantize(), weights, ids)
    assert relative_error(out, exact) < 0.1


@pytest.mark.parametrize("tile", [TILE, WIDE_TILE, NARROW_TILE], ids=["tile", "wide", "narrow"])
@pytest.mark.parametrize("t,e,k,h,i,per_channel", [(1, 6, 2, 72, 40, False), (2, 8, 4, 64, 48, False),
                                                   (2, 4, 2, 64, 32, True)])
def test_decode_experts_fp8_matches_reference(runner, t, e, k, h, i, per_channel, tile):
    g = case_generator("decode", t, e, k, h, i, per_channel)
    w13, w2 = experts(g, e, h, i, per_channel)
    x, weights, ids = route(g, t, e, k, h)
    dev = runner.device
    counters = DecodeCounters.create(t, e, k, h, i, tile, dev)
    out = fill_nan_(torch.empty(t, h, device=dev))
    runner(EXPERTS, x.to(dev), nan_padded(w13, dev), nan_padded(w2, dev), weights.to(dev), ids.to(dev),
           counters=counters, out=out, tile=tile)
    want = fused_moe_fp8_reference(x, w13, w2, weights, ids, quantize_activations=False)
    assert relative_error(out, want) < 1e-5
    assert int(counters.down.count_nonzero()) == 0, "the kernel must leave its arrival counters at zero"


def test_expert_parallel_ranks_add_up(runner):
    """EP=2: each rank holds half the experts (its slice of q and scales, the same row map);
    both paths' partial outputs sum to the whole."""
    g = case_generator("ep")
    t, e, k, h, i = 2, 8, 3, 64, 32
    w13, w2 = experts(g, e, h, i)
    x, weights, ids = route(g, t, e, k, h)
    dev = runner.device
    whole = fused_moe_fp8_reference(x, w13, w2, weights, ids)
    fused, dec = [], []
    for rank in range(2):
        emap = torch.full((e,), -1, dtype=torch.int32)
        emap[rank * 4:(rank + 1) * 4] = torch.arange(4, dtype=torch.int32)
        sl = slice(rank * 4, (rank + 1) * 4)
        r13 = Fp8Weight(w13.q[sl], w13.scale[sl], w13.scale_row, w13.group_k)
        r2 = Fp8Weight(w2.q[sl], w2.scale[sl], w2.scale_row, w2.group_k)
        fused.append(runner(FUSED, x.to(dev), to(r13, dev), to(r2, dev), weights.to(dev), ids.to(dev),
                            expert_map=emap.to(dev)).cpu())
        counters = DecodeCounters.create(t, e, k, h, i, TILE, dev)
        dec.append(runner(EXPERTS, x.to(dev), to(r13, dev), to(r2, dev), weights.to(dev), ids.to(dev),
                          counters=counters, expert_map=emap.to(dev), tile=TILE).cpu())
    assert relative_error(fused[0] + fused[1], whole) < W8A8_TOL
    assert relative_error(dec[0] + dec[1], fused_moe_fp8_reference(x, w13, w2, weights, ids,
                                                                   quantize_activations=False)) < 1e-5


def test_bad_arguments_are_refused():
    from kernels.fp8_moe import fused_moe_fp8
    g = case_generator("bad")
    w13, w2 = experts(g, 4, 32, 16)
    x, weights, ids = route(g, 2, 4, 2, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_moe_fp8(x, Fp8Weight(w13.q.float(), w13.scale, w13.scale_row, w13.group_k), w2, weights, ids)
    with pytest.raises(ValueError, match="scale rows"):
        fused_moe_fp8(x, Fp8Weight(w13.q, w13.scale, w13.scale_row[:4], w13.group_k), w2, weights, ids)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("t", [1, 24])
def test_fp8_experts_replay_in_a_cuda_graph(t):
    """The per-pair decode kernel (its counters back at zero after each replay) and the grouped
    GEMMs capture; replays with new tokens give the eager result."""
    from kernels.fp8_moe import experts_fp8, fused_moe_fp8

    g = case_generator("graph", t)
    e, k, h, i = 16, 4, 512, 256
    w13, w2 = (to(w, "cuda") for w in experts(g, e, h, i))
    x, weights, ids = (a.to("cuda") for a in route(g, t, e, k, h))
    x = x.to(torch.bfloat16)
    counters = DecodeCounters.create(t, e, k, h, i, DecodeTile(), "cuda")

    def run():
        if t <= 2:
            return experts_fp8(x, w13, w2, weights, ids, counters=counters)
        return fused_moe_fp8(x, w13, w2, weights, ids)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(2):
        x.copy_(torch.randn(t, h, generator=g).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run())
        assert int(counters.down.count_nonzero()) == 0
