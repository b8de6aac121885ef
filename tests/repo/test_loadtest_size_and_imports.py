"""loadtest/ stays the load tool and the maintained `duet bench` suite, not a lab: under 6960 lines
of Python, no one-off `*_probe.py` anywhere in the tree, and at the top of the layers: nothing in
services/, shared/, kernels/ or protos/ imports it, and it measures kernels through the engine,
never by importing kernels/ itself (their own benchmarks were probes; their figures are in
docs/performance/)."""
from __future__ import annotations

import subprocess

import pytest

from tests.repo.test_import_cycles import REPO, import_graph, source_modules

MAX_LINES = 6960  # 6950 until the stack sections fit a CPU shape's vocabulary to the tokenizer, 6900 until the router's placements per rate point, 6000 until the `lora` section of `duet bench`, 6100 until `tp_fp8` and `hetero_tp`, 6350 until `failover`, 6650 until `--settle-seconds`, 6700 until `saturation`, 6850 until the chat rows' KV tiers and the failover pin


def tracked(path: str = ".") -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", path], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def test_loadtest_is_under_its_line_budget():
    lines = sum(len((REPO / f).read_text().splitlines()) for f in tracked("loadtest") if f.endswith(".py"))
    assert 0 < lines < MAX_LINES, f"loadtest/ holds {lines} lines of Python (budget {MAX_LINES})"


def test_no_probe_files_in_the_tree():
    probes = [f for f in tracked() if f.endswith("_probe.py")]
    assert not probes, f"one-off probes belong in git history, their findings in docs/performance/: {probes}"


def test_loadtest_is_the_top_layer_and_does_not_reach_into_kernels():
    graph = import_graph(source_modules())
    upward = sorted(f"{a} -> {b}" for a, edges in graph.items() if not a.startswith("loadtest")
                    for b in edges if b.startswith("loadtest"))
    assert not upward, "imports of loadtest from below it:\n" + "\n".join(upward)
    into_kernels = sorted(f"{a} -> {b}" for a, edges in graph.items() if a.startswith("loadtest")
                          for b in edges if b.startswith("kernels"))
    assert not into_kernels, "loadtest importing kernels/ directly:\n" + "\n".join(into_kernels)


def test_the_checks_see_what_they_are_for():
    graph = import_graph(source_modules())
    assert any(b.startswith("shared") for a, edges in graph.items() if a.startswith("loadtest") for b in edges)
    assert any(b.startswith("kernels") for a, edges in graph.items() if a.startswith("shared") for b in edges)
    assert "loadtest/bench/suite.py" in tracked("loadtest")
