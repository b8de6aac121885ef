"""small_batch_linear and small_batch_gate_up_silu: Triton vs the torch reference on fresh
random inputs (M 1..16, N and K off the block sizes, bias, split-K forced on and off, both
math paths), bit-identical reruns, bad input, and the config table's lookups."""

import pytest
import torch

from tests.helpers.accuracy import fill_nan_, relative_error
from kernels.small_batch_linear import (SmallBatchWorkspace, small_batch_gate_up_silu_reference,
                                        small_batch_linear_reference, small_batch_preferred,
                                        small_batch_supported)
from kernels.small_batch_linear_config import (PARTIAL_FLOATS, TUNED, TUNED_FP8, ShapeKey, SmallBatchConfig,
                                               get_config, gpu_key, heuristic_config, m_bucket, tuned_config)
from tests.helpers.kernel_dtypes import CUDA, case_generator

LINEAR = "kernels.small_batch_linear:small_batch_linear"
GATE_UP = "kernels.small_batch_linear:small_batch_gate_up_silu"
# a K-long fp32 dot rounds like one accumulation; half types round the output once
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# interpreter: fp16 (its bf16 dot is wrong) and fp32; natively bf16 too
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float16, torch.float32]

SPLIT = SmallBatchConfig(block_n=16, block_k=32, split_k=3)  # K=200: 7 blocks -> splits of 3, 3, 1
NO_SPLIT = SmallBatchConfig(block_n=32, block_k=64, split_k=1)
FMA_SPLIT = SmallBatchConfig(block_n=16, block_k=64, split_k=2, use_dot=False)


def _inputs(m, n, k, dtype, device, *case):
    g = case_generator(m, n, k, dtype, *case)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype)
    return x, w, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("config", [SPLIT, NO_SPLIT, FMA_SPLIT], ids=["split", "nosplit", "fma-split"])
def test_linear_matches_reference(runner, dtype, m, config):
    n, k = 72, 200  # neither a multiple of any block
    x, w, bias = _inputs(m, n, k, dtype, runner.device, config)
    out = fill_nan_(torch.empty(m, n, dtype=dtype, device=runner.device))
    ws = SmallBatchWorkspace.create(runner.device, max_partial_floats=4096, max_tiles=64)
    runner(LINEAR, x, w, bias, out=out, config=config, workspace=ws)
    assert relative_error(out, small_batch_linear_reference(x, w, bias)) < TOLERANCE[dtype]
    assert not ws.counters.any()  # the last program of every tile reset its counter
    got = runner(LINEAR, x, w, config=config)  # no bias; per-call workspace
    assert relative_error(got, small_batch_linear_reference(x, w)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,config", [(1, SPLIT), (5, NO_SPLIT), (2, FMA_SPLIT), (16, SPLIT)])
def test_gate_up_silu_matches_reference(runner, dtype, m, config):
    inter, k = 40, 200
    x, w, _ = _inputs(m, 2 * inter, k, dtype, runner.device, "gate_up", config)
    w = w * 4  # pre-activations of a few units: silu's curve, not its linear part
    out = fill_nan_(torch.empty(m, inter, dtype=dtype, device=runner.device))
    runner(GATE_UP, x, w, out=out, config=config)
    assert relative_error(out, small_batch_gate_up_silu_reference(x, w)) < TOLERANCE[dtype]


def test_split_k_is_deterministic_and_strided_inputs(runner):
    """Two runs give the same bits; x and w may be row-strided views; K not a multiple of 8."""
    m, n, k = 7, 50, 129
    g = case_generator("strided", m, n, k)
    x_wide = torch.randn(m, k + 11, generator=g).to(runner.device)
    w_wide = torch.randn(n, k + 3, generator=g).to(runner.device)
    x, w = x_wide[:, 5:5 + k], w_wide[:, :k]
    ws = SmallBatchWorkspace.create(runner.device, max_partial_floats=4096, max_tiles=64)
    first = runner(LINEAR, x, w, config=SPLIT, workspace=ws)
    second = runner(LINEAR, x, w, config=SPLIT, workspace=ws)
    assert torch.equal(first, second)
    assert relative_error(first, small_batch_linear_reference(x, w)) < 1e-5


def test_default_config_and_empty_splits(runner):
    """config=None (heuristic on this machine), and more splits than K blocks."""
    x, w, bias = _inputs(4, 300, 256, torch.float32, runner.device, "default")
    got = runner(LINEAR, x, w, bias)
    assert relative_error(got, small_batch_linear_reference(x, w, bias)) < 1e-5
    many = SmallBatchConfig(block_n=64, block_k=64, split_k=16)  # 4 K blocks
    got = runner(LINEAR, x, w, config=many)
    assert relative_error(got, small_batch_linear_reference(x, w)) < 1e-5


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_with_split_k():
    from kernels.small_batch_linear import small_batch_linear

    x, w, bias = _inputs(8, 4096, 4096, torch.bfloat16, torch.device("cuda"), "graph")
    ws = SmallBatchWorkspace.create("cuda")
    cfg = SmallBatchConfig(block_n=32, block_k=256, split_k=4)
    out = torch.empty(8, 4096, dtype=torch.bfloat16, device="cuda")
    small_batch_linear(x, w, bias, out=out, config=cfg, workspace=ws)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small_batch_linear(x, w, bias, out=out, config=cfg, workspace=ws)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    x.copy_(torch.randn_like(x))  # new inputs in the same buffer
    graph.replay()
    assert relative_error(out, small_batch_linear_reference(x, w, bias)) < TOLERANCE[torch.bfloat16]


def test_bad_input_is_refused():
    from kernels.small_batch_linear import small_batch_gate_up_silu, small_batch_linear

    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="1..16 rows"):
        small_batch_linear(torch.randn(17, 16), w)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        small_batch_linear(x, torch.randn(8, 12))
    with pytest.raises(ValueError, match="share one of"):
        small_batch_linear(x, w.half())
    with pytest.raises(ValueError, match="contiguous"):
        small_batch_linear(x, torch.randn(16, 8).T)
    with pytest.raises(ValueError, match="bias"):
        small_batch_linear(x, w, torch.randn(7))
    with pytest.raises(ValueError, match="out"):
        small_batch_linear(x, w, out=torch.empty(2, 9))
    with pytest.raises(ValueError, match="even"):
        small_batch_gate_up_silu(x, torch.randn(7, 16))
    ws = SmallBatchWorkspace.create("cpu", max_partial_floats=8, max_tiles=2)
    with pytest.raises(ValueError, match="workspace too small"):
        ws.buffers(9, 1)
    with pytest.raises(ValueError, match="power of two"):
        SmallBatchConfig(block_n=24)


def test_supported_and_config_lookup(monkeypatch):
    assert small_batch_supported(1, 4096, 4096, torch.bfloat16)
    assert small_batch_supported(16, 151936, 1024, torch.float16)
    assert not small_batch_supported(17, 4096, 4096, torch.bfloat16)
    assert not small_batch_supported(4, 4096, 4100, torch.bfloat16)  # rows not whole 16-byte vectors
    assert not small_batch_supported(4, 4096, 4096, torch.int8)
    assert small_batch_preferred(8, 6144, 4096, torch.bfloat16)
    assert small_batch_supported(8, 6144, 4096, torch.float32)
    assert not small_batch_preferred(8, 6144, 4096, torch.float32)
    assert [m_bucket(m) for m in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    for gpu, table in TUNED.items():  # every tuned entry is a bucket and a valid tiling
        assert gpu_key(f"NVIDIA {gpu} 80GB HBM3") == gpu
        for key, row in table.items():
            assert set(row) <= {1, 2, 4, 8, 16} and key.n > 0 and key.k > 0
    # per GPU: the H100's table does not leak to other devices, buckets it lacks fall back
    assert tuned_config(1, 6144, 4096, "H100") == TUNED["H100"][ShapeKey(6144, 4096)][1]
    assert get_config(1, 6144, 4096, gpu="H100") == TUNED["H100"][ShapeKey(6144, 4096)][1]
    assert tuned_config(1, 6144, 4096, "") is None and tuned_config(2, 6144, 4096, "H100") is None
    assert get_config(1, 6144, 4096) == heuristic_config(1, 6144, 4096, 2, 132)
    assert gpu_key("NVIDIA A100-SXM4-80GB") == ""
    # an unknown shape gets the heuristic: split-K only when the tiles cannot fill the SMs
    assert get_config(1, 12345, 4096) == heuristic_config(1, 12345, 4096, 2, 132)
    assert heuristic_config(1, 151936, 4096, 2, 132).split_k == 1
    assert heuristic_config(1, 1024, 3072, 2, 132).split_k > 1
    # FP8 weights (one byte) read TUNED_FP8, never a 16-bit entry, and the reverse
    assert set(TUNED_FP8) == set(TUNED)
    fp8_entry = SmallBatchConfig(16, 1024, 1, 4, 1, False)
    monkeypatch.setitem(TUNED_FP8, "H100", {ShapeKey(6144, 4096): {1: fp8_entry}})
    assert get_config(1, 6144, 4096, 1, 132, gpu="H100") == fp8_entry
    assert get_config(1, 6144, 4096, 2, 132, gpu="H100") == TUNED["H100"][ShapeKey(6144, 4096)][1]
    assert get_config(2, 6144, 4096, 1, 132, gpu="H100") == heuristic_config(2, 6144, 4096, 1, 132)
    # FP8 weights stay on this kernel up to 32 rows (one more bucket); 16-bit ones stop at 16
    assert [m_bucket(m, fp8=True) for m in (16, 17, 32)] == [16, 32, 32]
    for bad in (lambda: m_bucket(17), lambda: m_bucket(33, fp8=True), lambda: get_config(17, 64, 64, 2)):
        with pytest.raises(ValueError, match="rows"):
            bad()
    for gpu, table in TUNED_FP8.items():
        for key, row in table.items():
            assert set(row) <= {1, 2, 4, 8, 16, 32}, (gpu, key)
    # the heuristic's split-K never asks for more scratch than a default workspace holds
    for m, n, gate_up in ((32, 2 * 12288, True), (32, 6144, False), (32, 151936, False)):
        cfg = heuristic_config(m, n, 4096, 1, 132, gate_up)
        assert cfg.split_k * (2 if gate_up else 1) * m * (n // 2 if gate_up else n) <= PARTIAL_FLOATS or cfg.split_k == 1
