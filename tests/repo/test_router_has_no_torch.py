"""The router reads KV pool records from the registry and never touches a tensor: importing
it must not import torch (2+ s of every router start, and a router image without it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_router_leaves_torch_out():
    probe = "import sys, services.router.server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "importing the router imports torch"
