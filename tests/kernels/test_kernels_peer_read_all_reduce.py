"""The read-every-peer all-reduce kernel (kernels/triton_peer_read_all_reduce.py, the custom
all-reduce's "barrier" mode) as one rank among simulated peers (tests/helpers/peer_all_reduce_sim.py):
each rank's buffer is a local tensor, so the sum + add + RMSNorm is checked against the torch
reference (kernels/peer_all_reduce.py) without a second GPU. Interpreted on CPU, native on a
GPU. The symmetric-memory barriers around it need real peers (two GPUs)."""

import pytest
import torch

from kernels.peer_all_reduce import all_reduce_add_rms_norm_ref
from tests.helpers.kernel_dtypes import case_generator, kernel_dtypes

SIM = "tests.helpers.peer_all_reduce_sim"


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", kernel_dtypes(fp16=False))
def test_read_reduce_matches_reference(runner, world, rank, rows, norm, dtype):
    dev = runner.device
    g = case_generator(world, rank, rows, norm, dtype)
    hidden = 200  # not a power of two: masked columns
    partials = [(torch.randn(rows, hidden, generator=g) * 2).to(dev, dtype) for _ in range(world)]
    residual = torch.randn(rows, 2 * hidden, generator=g).to(dev, dtype)[:, :hidden] if norm else None  # strided
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dev, dtype) if norm else None
    out, res = runner(f"{SIM}:run_read_reduce", rank, partials, residual, weight, 1e-6)
    ref_out, ref_res = all_reduce_add_rms_norm_ref(partials, residual, weight, 1e-6)
    assert out.shape == (rows, hidden)
    if norm:
        assert torch.equal(res, ref_res)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(out.float(), ref_out.float(), rtol=0, atol=tol)
    else:
        assert res is None
        assert torch.equal(out, ref_out)  # the rank-order float32 sum, bit for bit
