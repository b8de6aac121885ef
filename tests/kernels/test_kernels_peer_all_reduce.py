"""The fused peer all-reduce kernel (kernels/triton_peer_all_reduce.py) as one rank among
simulated peers (tests/helpers/peer_all_reduce_sim.py): the sum + add + RMSNorm against the torch
reference, what it pushes into the other ranks' buffers and flags, the phase and epoch
bookkeeping over consecutive calls, and the token push and its bounded wait. Interpreted
on CPU, native on a GPU. On two GPUs `duet bench --sections tp` runs greedy tokens and decode
steps through it."""

import pytest
import torch

from kernels.peer_all_reduce import all_reduce_add_rms_norm_ref
from tests.helpers.kernel_dtypes import kernel_dtypes

SIM = "tests.helpers.peer_all_reduce_sim"


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("rows", [1, 3, 9])  # fewer rows than programs, and more (programs loop)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", kernel_dtypes(fp16=False))
def test_reduce_matches_reference_and_signals_peers(runner, world, rank, rows, norm, dtype):
    dev = runner.device
    g = torch.Generator().manual_seed(rows * 10 + world)
    hidden = 200  # not a power of two: masked columns
    calls = [[(torch.randn(rows, hidden, generator=g) * 2).to(dev, dtype) for _ in range(world)]
             for _ in range(3)]
    residual = torch.randn(rows, hidden, generator=g).to(dev, dtype) if norm else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dev, dtype) if norm else None
    results, errors, counters = runner(f"{SIM}:run_calls", rank, calls, residual, weight, 1e-6)
    assert errors == 0
    assert counters.tolist() == [3] * 4  # every program took part in every call
    for e, (partials, (out, res, got, flags)) in enumerate(zip(calls, results), start=1):
        ref_out, ref_res = all_reduce_add_rms_norm_ref(partials, residual, weight, 1e-6)
        if norm:
            assert torch.equal(res, ref_res)
            assert (out.float() - ref_out.float()).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 1e-5)
        else:
            assert torch.equal(out, ref_out)  # the rank-order float32 sum, bit for bit
        for q in range(world):
            assert torch.equal(got[q], partials[rank])  # our rows landed in every rank's slot
            assert flags[q].tolist() == [e] * 4  # and every program announced them


def test_token_push_reaches_every_ring_and_a_missing_push_gives_up(runner):
    tokens = torch.arange(5, 5 + 300, dtype=torch.int64, device=runner.device)  # > one block
    rings, flags, errors_after_ok, errors_after_missing, errors_after_next = runner(
        f"{SIM}:run_tokens", 0, 3, tokens, 17)
    for ring in rings:
        assert torch.equal(ring, tokens)
    assert flags == [0, 3, 3]  # the pusher does not flag itself
    assert errors_after_ok == 0
    assert errors_after_missing == 1
    assert errors_after_next == 2  # 2^30 polls would take minutes interpreted: it did not spin
