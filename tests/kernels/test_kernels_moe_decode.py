"""The three-launch decode MoE (router + top-k, gate/up, down + top-k sum) against its torch
reference: one token and several, E not a power of two, top-k 1/2/8, an expert map with
experts on another rank, tiles that leave ragged edges, the arrival counters left zeroed
(the next call, as a CUDA graph replays it, gives the same bits), bad arguments."""
import pytest
import torch

from kernels.moe_decode import DecodeCounters, DecodeTile, moe_decode_reference
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import case_generator, kernel_dtypes

DECODE = "kernels.moe_decode:moe_decode"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SMALL = DecodeTile(router_block_e=4, router_block_k=32, gate_up_block_n=8, gate_up_block_k=32,
                   down_block_n=16, down_block_k=16)  # down_block_k < I: the down side's K loop


def _case(g, t, e, k, h, i, dtype):
    x = torch.randn(t, h, generator=g).to(dtype)
    router = (torch.randn(e, h, generator=g) * 2 / h ** 0.5).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    return x, router, w13, w2


def _run(runner, x, router, w13, w2, k, renorm, round_to=None, emap=None, tile=SMALL, counters=None):
    dev = runner.device
    args = [a.to(dev) for a in (x, router, w13, w2)]
    out = fill_nan_(torch.empty_like(args[0]))
    if counters is None:
        counters = DecodeCounters.create(x.shape[0], router.shape[0], k, x.shape[1], w2.shape[2], tile, dev)
    got, w, ids = runner(DECODE, *args, k, renorm, round_to, expert_map=None if emap is None else emap.to(dev),
                         out=out, counters=counters, tile=tile)
    return got.cpu(), w.cpu(), ids.cpu(), counters


def _check(runner, x, router, w13, w2, k, renorm, round_to=None, emap=None, tile=SMALL):
    got, w, ids, counters = _run(runner, x, router, w13, w2, k, renorm, round_to, emap, tile)
    want, want_w, want_ids = moe_decode_reference(x, router, w13, w2, k, renorm, round_to, expert_map=emap)
    assert [set(r) for r in ids.tolist()] == [set(r) for r in want_ids.tolist()]
    assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(got).all()
    assert relative_error(got, want) < TOL[x.dtype]
    assert int(counters.router.count_nonzero()) + int(counters.down.count_nonzero()) == 0, "the kernels must leave their arrival counters at zero"
    return got


@pytest.mark.parametrize("dtype", kernel_dtypes(fp16=False))
@pytest.mark.parametrize("t,e,k,h,i,renorm", [(1, 8, 2, 64, 32, True), (3, 60, 4, 72, 40, False),
                                              (5, 16, 8, 48, 24, True), (2, 4, 1, 40, 16, False)])
def test_moe_decode_matches_reference(runner, dtype, t, e, k, h, i, renorm):
    g = case_generator(t, e, k, h, i, dtype)
    _check(runner, *_case(g, t, e, k, h, i, dtype), k, renorm)


@pytest.mark.parametrize("t,e,k,renorm,ties", [(1, 8, 2, True, False), (3, 60, 4, False, False),
                                                (2, 128, 8, True, False), (2, 16, 4, True, True)])
def test_sorted_top_k_matches_the_argmax_rounds(runner, t, e, k, renorm, ties):
    """router_sort: the same experts in the same slot order and the same weights (to the last
    bits) as the k rounds of argmax (ties: lower expert first), and the reference."""
    import dataclasses
    g = case_generator("sort", t, e, k, ties)
    x, router, w13, w2 = _case(g, t, e, k, 32, 16, torch.float32)
    if ties:  # pairs of identical router rows: equal logits, equal probabilities
        router[1::2] = router[0::2]
    plain = _run(runner, x, router, w13, w2, k, renorm)
    got = _run(runner, x, router, w13, w2, k, renorm, tile=dataclasses.replace(SMALL, router_sort=True))
    assert torch.equal(got[2], plain[2])  # the same experts in the same slots
    # the renormalising sum adds the same k values over a wider vector: last-bit differences
    assert torch.allclose(got[1], plain[1], rtol=1e-6, atol=0) and relative_error(got[0], plain[0]) < 1e-6
    _check(runner, x, router, w13, w2, k, renorm, tile=dataclasses.replace(SMALL, router_sort=True))


def test_default_tiles_and_rounded_weights(runner):
    """Qwen's routers round the top-k weights to the activations' dtype."""
    g = case_generator("default")
    x, router, w13, w2 = _case(g, 2, 16, 4, 96, 48, torch.float32)
    _check(runner, x, router, w13, w2, 4, True, round_to=torch.float16, tile=DecodeTile())


def test_expert_map_ranks_add_up_to_the_whole(runner):
    """EP=2: each rank holds half the experts; the two partial outputs sum to the whole."""
    g = case_generator("ep")
    t, e, k, h, i = 3, 8, 3, 64, 32
    x, router, w13, w2 = _case(g, t, e, k, h, i, torch.float32)
    whole = _check(runner, x, router, w13, w2, k, True)
    parts = []
    for rank in range(2):
        emap = torch.full((e,), -1, dtype=torch.int32)
        emap[rank * 4:(rank + 1) * 4] = torch.arange(4, dtype=torch.int32)
        parts.append(_check(runner, x, router, w13[rank * 4:(rank + 1) * 4], w2[rank * 4:(rank + 1) * 4], k, True,
                            emap=emap))
    assert relative_error(parts[0] + parts[1], whole) < 1e-5


def test_counters_survive_repeated_calls_with_the_same_bits(runner):
    g = case_generator("repeat")
    x, router, w13, w2 = _case(g, 4, 12, 3, 64, 32, torch.float32)
    a, _, _, counters = _run(runner, x, router, w13, w2, 3, True)
    b, _, _, _ = _run(runner, x, router, w13, w2, 3, True, counters=counters)
    assert torch.equal(a, b)


def test_agrees_with_the_grouped_path(runner):
    """The same block through select_experts + fused_moe (what prefill runs)."""
    g = case_generator("grouped")
    x, router, w13, w2 = _case(g, 3, 16, 4, 64, 32, torch.float32)
    got, w, ids, _ = _run(runner, x, router, w13, w2, 4, True)
    dev = runner.device
    grouped = runner("kernels.fused_moe:fused_moe", x.to(dev), w13.to(dev), w2.to(dev), w.to(dev), ids.to(dev))
    assert relative_error(got, grouped.cpu()) < 1e-5


def test_bad_arguments_are_refused():
    from kernels.moe_decode import moe_decode
    x = torch.randn(2, 16)
    w13, w2 = torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    with pytest.raises(ValueError, match="router_w"):
        moe_decode(x, torch.randn(4, 8), w13, w2, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        moe_decode(x, torch.randn(4, 16), w13, w2, 5, True)
    with pytest.raises(ValueError, match="expert_map"):
        moe_decode(x, torch.randn(6, 16), w13, w2, 2, True)
    with pytest.raises(ValueError, match="counters"):
        moe_decode(x, torch.randn(4, 16), w13, w2, 2, True, counters=DecodeCounters.create(1, 4, 2, 16, 8, DecodeTile()))
