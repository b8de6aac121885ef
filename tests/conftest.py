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


# Whole-stack layers first: with two workers taking a file at a time (`-n 2 --dist loadfile`),
# the long files start early and the short unit files fill in at the end, instead of one long
# file running alone after the rest are done. Within a layer the files keep their order.
LAYER_ORDER = ("e2e", "k8s", "disagg", "engine", "gateway", "loadtest", "kernels", "repo")


def pytest_collection_modifyitems(config, items):
    def layer(item) -> int:
        parts = item.nodeid.split("/")
        name = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
        return LAYER_ORDER.index(name) if name in LAYER_ORDER else len(LAYER_ORDER)
    items.sort(key=layer)  # stable: the order inside each layer is kept
