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
