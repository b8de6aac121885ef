"""Every Triton kernel the kernels package launches compiles for the GPU, checked on the CPU.

The kernel tests run on the CPU under TRITON_INTERPRET=1, which executes a kernel's Python
body and never runs Triton's code generator: it accepts what the GPU compiler refuses (a
name an `if` or a loop rebinds to another type or shape, a plain module global read inside
@triton.jit, an int argument equal to 1 that the GPU specialises into a constexpr). Here
tests/helpers/triton_lowering.py runs every launch path in tests/helpers/kernel_launch_cases.py
on empty CPU tensors (nothing executes), binds each launch as JITFunction.run would on an
H100 (signature, specialisation, constexprs, num_warps / num_stages / launch_pdl), and lowers
it for cuda sm_90: AST -> TTIR and the TTIR passes for every distinct launch, and the TTGIR
passes for the first launch of each kernel. One subprocess, without the interpreter.

Modules covered (each through its wrappers, bf16 / fp16 / fp32, FP8 weights and FP8 KV caches,
PDL launches, the tiles a GPU picks at Qwen3-8B / Qwen3-30B-A3B shapes and the CPU's):
kernels/triton_decode_attention.py, triton_extend_attention.py, triton_verify_attention.py,
triton_store_kv.py, triton_page_copy.py, triton_qk_norm_rope.py, triton_rotary_embedding.py,
triton_rms_norm.py, triton_silu_and_mul.py, triton_small_batch_linear.py, triton_fp8_gemm.py, triton_fp8_decode_gemm.py,
triton_fp8_moe.py, triton_fused_moe.py, triton_moe_decode.py, triton_rejection_sample.py, triton_lora.py,
triton_peer_all_reduce.py, triton_peer_read_all_reduce.py; the device-function modules
triton_fp8.py, triton_f16_rows.py, triton_moe_topk.py and triton_pdl.py through the kernels that
call them; and
the tests' own probe kernel (tests/helpers/fp8_grid_kernel.py).

The last two tests show it fails where the GPU did: on the rejection kernel with its old
`q` (a scalar in the draft loop, a tile in the vocabulary loop's `if`), and on FP8_MAX as a
plain float global.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.triton_lowering import jit_functions, launched_kernels

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "helpers" / "triton_lowering.py"


def lower(out_dir: Path, groups: tuple[str, ...] = (), kernels_copy: Path | None = None) -> dict:
    """Runs the catalogue (or some of its groups) in a child without TRITON_INTERPRET;
    kernels_copy: a folder holding a `kernels` package to use instead of the repo's."""
    # neither the interpreter nor the escape hatch for non-constexpr globals: what a GPU runs
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_ALLOW_NON_CONSTEXPR_GLOBALS")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (kernels_copy, REPO) if p is not None)
    out = out_dir / "lowering.json"
    cmd = [sys.executable, str(SCRIPT), str(out)] + (["--groups", ",".join(groups)] if groups else [])
    proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert Path(report["kernels_package"]) == (kernels_copy or REPO) / "kernels"
    return report


def failure_text(report: dict) -> str:
    parts = [f"{name}: wrapper raised\n{tb}" for name, tb in report["group_errors"].items()]
    parts += [f"{f['launch']}\n  -> {f['error']}" for f in report["failures"]]
    return "\n\n".join(parts)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return lower(tmp_path_factory.mktemp("lowering"))


def test_every_launch_lowers_for_sm90(report):
    assert report["unique"] > 500, report  # the catalogue ran, not a stub
    assert not report["group_errors"] and not report["failures"], failure_text(report)


# device functions a GPU never runs: kernels/triton_fp8.py picks fp8_grid_arith only under
# Triton's interpreter (whose float-to-fp8 cast rounds wrongly); the GPU uses its conversion
INTERPRETER_ONLY = {"kernels.triton_fp8.fp8_grid_arith"}


def test_every_launched_kernel_and_device_function_is_covered(report):
    lowered = set(report["kernels"])
    launched = {f"{module}.{name}" for module, name in launched_kernels(REPO / "kernels")}
    assert launched, "no kernel[grid](...) launch found in kernels/triton_*.py"
    assert launched <= lowered, f"launched but never recorded: {sorted(launched - lowered)}"
    reached = lowered | set(report["functions"])
    defined = {f"{module}.{name}" for module, names in jit_functions(REPO / "kernels").items() for name in names}
    defined -= INTERPRETER_ONLY
    assert defined <= reached, f"@triton.jit functions no recorded launch reaches: {sorted(defined - reached)}"


def _scratch_kernels(tmp_path: Path, module: str, old: str, new: str) -> Path:
    """A copy of the kernels package with one regex substitution in one module."""
    root = tmp_path / "scratch"
    shutil.copytree(REPO / "kernels", root / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    path = root / "kernels" / f"{module}.py"
    text, n = re.subn(old, new, path.read_text())
    assert n, f"{old!r} not in {path.name}: update this test's mutation"
    path.write_text(text)
    return root


def test_fails_on_a_name_an_if_rebinds_to_a_tile(tmp_path):
    """The rejection kernel as it was: the vocabulary loop's `if resid:` loads a tile into
    `q`, the draft loop's fp32 scalar (the GPU refused it; the interpreter ran it)."""
    scratch = _scratch_kernels(tmp_path, "triton_rejection_sample", r"\bqv\b", "q")
    report = lower(tmp_path, ("triton_rejection_sample",), scratch)
    failed = {f["kernel"]: f["error"] for f in report["failures"]}
    assert set(failed) == {"kernels.triton_rejection_sample._rejection_kernel"}, failure_text(report)
    assert "`q`" in failed["kernels.triton_rejection_sample._rejection_kernel"]


def test_fails_on_a_plain_global_read_in_a_jit_function(tmp_path):
    """FP8_MAX as a plain float (not tl.constexpr): every kernel that rounds to FP8 fails."""
    scratch = _scratch_kernels(tmp_path, "triton_fp8", r"FP8_MAX = tl\.constexpr\((.*?)\)", r"FP8_MAX = \1")
    report = lower(tmp_path, ("triton_store_kv",), scratch)
    failed = {f["kernel"]: f["error"] for f in report["failures"]}
    assert set(failed) == {"kernels.triton_store_kv._store_kv_kernel"}, failure_text(report)
    assert "FP8_MAX" in failed["kernels.triton_store_kv._store_kv_kernel"]
