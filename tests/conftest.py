"""Fixtures shared across test modules."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def torch_one_thread():
    """One intra-op thread for a module: small models run faster that way on the shared
    2-core machine, and results do not depend on how many threads the machine has."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def runner():
    """Runs Triton kernels: natively on CUDA, else in one child process per module under
    Triton's CPU interpreter (tests/helpers/kernel_runner.py says why a child)."""
    from tests.helpers.kernel_runner import KernelRunner
    r = KernelRunner()
    yield r
    r.close()
