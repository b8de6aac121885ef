"""Where the decode kernels let the next kernel be scheduled under PDL (kernels/pdl.py), checked
on the CPU in the sm_90 PTX: each launch is bound as a GPU launch would be (tests/helpers/
triton_lowering.py's Recorder, on empty CPU tensors; nothing runs) and compiled for sm_90.

At one row the kernels with a main loop signal on entry (`griddepcontrol.launch_dependents` before
their wait), so the next kernel's programs can pull their first weight tiles early; from 2 to 16
rows the decode GEMM, the small-batch linear and decode attention's first stage wait first and
signal only after their main loop (an early signal let the next kernel's programs take SM slots the
loop wanted); past 16 rows on entry again. The short kernels (no main loop) wait, then signal, at
every size. A signal moved to the wrong place still gives the same numbers, so
only the code shows it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

CUDA = torch.device("cuda")  # only handed to the config pickers (pure Python)


def _ptx_lines(launch) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    kernel = triton.compile(ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs),
                            target=GPUTarget("cuda", 90, 32), options=launch.options.__dict__)
    return kernel.asm["ptx"].splitlines()


def _first(lines, *needles):
    return next(i for i, line in enumerate(lines) if any(n in line for n in needles))


def _last(lines, *needles):
    return max(i for i, line in enumerate(lines) if any(n in line for n in needles))


@pytest.fixture(scope="module")
def launches():
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    from kernels.decode_attention import decode_attention
    from kernels.fp8 import ACT_EPS
    from kernels.fp8_decode_gemm import decode_config
    from kernels.pdl import engine_pdl
    from kernels.qk_norm_rope import qk_norm_rope
    from kernels.rms_norm import rms_norm
    from kernels.small_batch_linear import SmallBatchWorkspace, small_batch_linear
    from kernels.small_batch_linear_config import get_config
    from kernels.triton_fp8_decode_gemm import launch_fp8_decode_gemm
    from tests.helpers.kernel_launch_cases import _fp8_weight, _paged
    from tests.helpers.triton_lowering import Recorder

    pdl = engine_pdl(1, "fp8", "dense")  # PDL to 32 rows, late from 2 to 16
    ws = SmallBatchWorkspace.create("cpu", max_partial_floats=1 << 24, max_tiles=1 << 12)
    w8 = _fp8_weight(6144, 4096, (128, 128))
    w16 = torch.empty(6144, 4096, dtype=torch.bfloat16)
    got = {}
    with Recorder(make_backend(GPUTarget("cuda", 90, 32))) as rec:
        for m in (1, 8, 24):
            launch_fp8_decode_gemm(torch.empty(m, 4096, dtype=torch.bfloat16), w8, None,
                                   torch.empty(m, 6144, dtype=torch.bfloat16),
                                   decode_config(m, 6144, 4096, 132, False, 128, CUDA), ws, False, pdl, 128, ACT_EPS)
            got[("decode GEMM", m)] = rec.launches[-1]
            if m == 24:  # from 17 rows x is quantized by its own launch first (Fp8DecodeConfig.prequant)
                got[("x quantization", m)] = rec.launches[-2]
        for m in (1, 8):
            small_batch_linear(torch.empty(m, 4096, dtype=torch.bfloat16), w16, workspace=ws, pdl=pdl,
                               config=get_config(m, 6144, 4096, 2, 132, False, "H100"))
            got[("small-batch linear", m)] = rec.launches[-1]
        for b in (1, 8):
            kc, vc, table, lens = _paged([300] * b, 8, 128, 16, torch.bfloat16)
            start = len(rec.launches)
            decode_attention(torch.empty(b, 32, 128, dtype=torch.bfloat16), kc, vc, table, lens, 0.125,
                             num_kv_splits=2, pdl=pdl)
            got[("attention stage 1", b)] = next(lc for lc in rec.launches[start:]
                                                 if lc.fn.__name__ == "_decode_stage1")
            got[("attention stage 2", b)] = next(lc for lc in rec.launches[start:]
                                                 if lc.fn.__name__ == "_decode_stage2")
        for m in (1, 8):
            rms_norm(torch.empty(m, 4096, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.bfloat16), 1e-6,
                     residual=torch.empty(m, 4096, dtype=torch.bfloat16), pdl=pdl)
            got[("rms norm", m)] = rec.launches[-1]
            qk_norm_rope(torch.zeros(m, dtype=torch.int64), torch.empty(m, 32, 128, dtype=torch.bfloat16),
                         torch.empty(m, 8, 128, dtype=torch.bfloat16), torch.empty(64, 128, dtype=torch.float32),
                         is_neox=True, pdl=pdl)
            got[("q/k norm + RoPE", m)] = rec.launches[-1]
    return got


@pytest.mark.parametrize("kind,rows,late", [("decode GEMM", 1, False), ("decode GEMM", 8, True),
                                            ("decode GEMM", 24, False), ("small-batch linear", 1, False),
                                            ("small-batch linear", 8, True), ("attention stage 1", 1, False),
                                            ("attention stage 1", 8, True)])
def test_the_signal_comes_after_the_main_loop_from_2_to_16_rows_only(launches, kind, rows, late):
    lines = _ptx_lines(launches[(kind, rows)])
    signal, wait = _first(lines, "griddepcontrol.launch_dependents"), _first(lines, "griddepcontrol.wait")
    assert sum("griddepcontrol.launch_dependents" in line for line in lines) == 1
    loop_math = ("mma", "fma.rn.f32")  # the loop's work: tensor-core dots, or one row's FMAs on the CUDA cores
    if late:
        assert wait < _first(lines, *loop_math) < _last(lines, *loop_math) < signal, kind
    else:
        assert signal < wait < _first(lines, *loop_math), kind



@pytest.mark.parametrize("kind,rows", [("rms norm", 1), ("rms norm", 8), ("q/k norm + RoPE", 1),
                                       ("q/k norm + RoPE", 8), ("attention stage 2", 1), ("attention stage 2", 8),
                                       ("x quantization", 24)])
def test_short_kernels_wait_before_they_signal(launches, kind, rows):
    """The kernels without a main loop wait for the kernel before, then let the next be scheduled
    (kernels/pdl.py wait_first_from_rows), then read: signalled on entry, a short kernel launched
    early let the big kernel after it be scheduled while the big kernel before it still ran."""
    lines = _ptx_lines(launches[(kind, rows)])
    signal, wait = _first(lines, "griddepcontrol.launch_dependents"), _first(lines, "griddepcontrol.wait")
    assert sum("griddepcontrol.launch_dependents" in line for line in lines) == 1
    assert wait < signal < _first(lines, "ld.global"), kind
