"""triton_available(): a cheap probe that never switches this process to the
interpreter; checked in child processes so the environment is controlled."""

import os
import subprocess
import sys

import torch

PROBE = "from kernels.availability import triton_available; import sys; " \
        "print(triton_available(), 'triton' in sys.modules)"


def _probe(interpret: str):
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    available, imported = out.stdout.split()
    return available == "True", imported == "True"


def test_interpreter_makes_triton_available():
    available, imported = _probe("1")
    assert available and imported


def test_without_interpreter_follows_cuda():
    available, imported = _probe("")
    assert available == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert not imported  # no import cost on a CPU-only process
