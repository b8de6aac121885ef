"""Fused MoE: the Triton kernels against their torch references on fresh random inputs.

Routing (softmax top-k, renormalised or not, E not a power of two) and the whole layer
(align + gate/up with SwiGLU + down with routing weights + top-k sum) over shapes that
cover one token, no tokens, experts that get nothing, every token on one expert, uneven
routing, top-k 1/2/8, an expert map with experts on another rank (expert parallelism),
dimensions off the tile sizes, and the torch alignment path for many pairs."""
import pytest
import torch

from kernels.fused_moe import fused_moe_reference, select_experts_reference
from tests.helpers.accuracy import fill_nan_, relative_error
from tests.helpers.kernel_dtypes import case_generator, kernel_dtypes

MOE = "kernels.fused_moe:fused_moe"
SELECT = "kernels.fused_moe:select_experts"
CUDA = torch.cuda.is_available()
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _weights(g, e, h, i, dtype):
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    return w13, w2


def _route(g, t, e, k, skew=None):
    """Random top-k ids per token (distinct per row); skew: favour these experts."""
    scores = torch.rand(t, e, generator=g)
    if skew is not None:
        scores[:, skew] += 10.0
    ids = scores.topk(k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(t, k, generator=g)
    return weights / weights.sum(-1, keepdim=True), ids


def _check(runner, x, w13, w2, weights, ids, expert_map=None, tol=None, config=None):
    dev = runner.device
    args = [a.to(dev) for a in (x, w13, w2, weights, ids)]
    emap = expert_map.to(dev) if expert_map is not None else None
    out = fill_nan_(torch.empty_like(args[0]))
    got = runner(MOE, *args, expert_map=emap, out=out, config=config)
    want = fused_moe_reference(*args, expert_map=emap)
    assert got.shape == want.shape
    if x.shape[0]:
        assert torch.isfinite(got).all()
        assert relative_error(got, want) < (tol or TOL[x.dtype])
    return got.cpu()


@pytest.mark.parametrize("dtype", kernel_dtypes(fp16=False))
@pytest.mark.parametrize("t,e,k,h,i", [(1, 8, 2, 64, 32), (5, 6, 2, 72, 40), (13, 16, 8, 64, 48),
                                       (3, 60, 4, 32, 16), (33, 4, 1, 48, 24)])
def test_fused_moe_matches_reference(runner, dtype, t, e, k, h, i):
    g = case_generator(t, e, k, h, i, dtype)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13, w2 = _weights(g, e, h, i, dtype)
    weights, ids = _route(g, t, e, k)
    _check(runner, x, w13, w2, weights, ids)


@pytest.mark.parametrize("t,e,k,h,i", [(1, 8, 2, 64, 32), (3, 60, 4, 72, 40), (4, 16, 8, 48, 24)])
def test_few_token_sizes_match_reference(runner, t, e, k, h, i):
    """The grouped GEMMs at decode sizes (16-row blocks mostly padding), with and without an
    expert map."""
    from kernels.fused_moe_config import GemmTile, MoEConfig
    config = MoEConfig(GemmTile(16, 32, 32), GemmTile(16, 32, 32))
    g = case_generator("grouped", t, e, k, h, i)
    x = torch.randn(t, h, generator=g)
    w13, w2 = _weights(g, e, h, i, torch.float32)
    weights, ids = _route(g, t, e, k)
    _check(runner, x, w13, w2, weights, ids, config=config)
    emap = torch.full((e,), -1, dtype=torch.int32)
    emap[e // 2:] = torch.arange(e - e // 2, dtype=torch.int32)
    _check(runner, x, w13[e // 2:], w2[e // 2:], weights, ids, expert_map=emap, config=config)


def test_every_token_on_one_expert_and_idle_experts(runner):
    g = case_generator("skew")
    t, e, k, h, i = 20, 8, 2, 64, 32
    x = torch.randn(t, h, generator=g)
    w13, w2 = _weights(g, e, h, i, torch.float32)
    weights, ids = _route(g, t, e, k, skew=[5, 2])  # experts 5 and 2 take every token, the rest none
    assert set(ids.flatten().tolist()) == {2, 5}
    _check(runner, x, w13, w2, weights, ids)


def test_no_tokens(runner):
    h, i, e = 32, 16, 4
    g = case_generator("empty")
    w13, w2 = _weights(g, e, h, i, torch.float32)
    got = runner(MOE, torch.empty(0, h), w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32))
    assert got.shape == (0, h)


def test_expert_map_drops_experts_on_other_ranks(runner):
    """EP=2 on 8 experts: this rank holds experts 4..7 as local 0..3; the two ranks' partial
    outputs add up to the single-rank result."""
    g = case_generator("ep")
    t, e, k, h, i = 9, 8, 3, 64, 32
    x = torch.randn(t, h, generator=g)
    w13, w2 = _weights(g, e, h, i, torch.float32)
    weights, ids = _route(g, t, e, k)
    whole = _check(runner, x, w13, w2, weights, ids)
    parts = []
    for rank in range(2):
        emap = torch.full((e,), -1, dtype=torch.int32)
        emap[rank * 4:(rank + 1) * 4] = torch.arange(4, dtype=torch.int32)
        parts.append(_check(runner, x, w13[rank * 4:(rank + 1) * 4], w2[rank * 4:(rank + 1) * 4], weights, ids,
                            expert_map=emap))
    assert relative_error(parts[0] + parts[1], whole) < 1e-5


def test_many_pairs_take_the_torch_alignment_and_agree(runner):
    """Above the single-program limit the layout comes from torch ops: same results."""
    from kernels.triton_fused_moe import ALIGN_SINGLE_PROGRAM_MAX
    g = case_generator("many")
    e, k, h, i = 16, 2, 32, 16
    t = ALIGN_SINGLE_PROGRAM_MAX // k + 7
    x = torch.randn(t, h, generator=g)
    w13, w2 = _weights(g, e, h, i, torch.float32)
    weights, ids = _route(g, t, e, k)
    emap = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], dtype=torch.int32)
    _check(runner, x, w13[:15], w2[:15], weights, ids, expert_map=emap)


def test_repeated_calls_give_the_same_bits(runner):
    g = case_generator("det")
    t, e, k, h, i = 7, 8, 2, 64, 32
    x = torch.randn(t, h, generator=g)
    w13, w2 = _weights(g, e, h, i, torch.float32)
    weights, ids = _route(g, t, e, k)
    a = _check(runner, x, w13, w2, weights, ids)
    b = _check(runner, x, w13, w2, weights, ids)
    assert torch.equal(a, b)


@pytest.mark.parametrize("t,e,k,renorm", [(1, 8, 2, True), (6, 60, 4, False), (17, 128, 8, True), (3, 64, 1, False)])
def test_select_experts_matches_reference(runner, t, e, k, renorm):
    g = case_generator(t, e, k, renorm)
    logits = torch.randn(t, e, generator=g) * 3
    weights, ids = runner(SELECT, logits.to(runner.device), k, renorm)
    want_w, want_ids = select_experts_reference(logits, k, renorm)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    # the same experts per row (random logits have no ties), weights in descending order
    assert [set(r) for r in ids.cpu().tolist()] == [set(r) for r in want_ids.tolist()]
    assert torch.allclose(weights.cpu(), want_w, rtol=1e-5, atol=1e-6)
    if renorm:
        assert torch.allclose(weights.cpu().sum(-1), torch.ones(t), atol=1e-5)


def test_select_experts_rounds_weights_in_the_kernel(runner):
    """HF's Qwen routers cast the top-k weights to the activations' dtype: the kernel's
    round_weights_to gives exactly those values (as float32)."""
    g = case_generator("round")
    logits = torch.randn(5, 16, generator=g) * 2
    got, _ = runner(SELECT, logits.to(runner.device), 4, True, torch.float16)
    want, _ = select_experts_reference(logits, 4, True)
    assert got.dtype == torch.float32
    assert torch.equal(got.cpu(), want.to(torch.float16).float())


def test_reference_matches_a_plain_loop():
    """The reference itself against the textbook formula in float64."""
    g = case_generator("ref")
    t, e, k, h, i = 4, 5, 2, 16, 8
    x = torch.randn(t, h, generator=g, dtype=torch.float64)
    w13, w2 = _weights(g, e, h, i, torch.float64)
    weights, ids = _route(g, t, e, k)
    want = torch.zeros(t, h, dtype=torch.float64)
    for tt in range(t):
        for j in range(k):
            ex = int(ids[tt, j])
            gate, up = (w13[ex] @ x[tt]).split(i)
            want[tt] += weights[tt, j].double() * (w2[ex] @ (torch.nn.functional.silu(gate) * up))
    assert relative_error(fused_moe_reference(x, w13, w2, weights, ids), want) < 1e-12
