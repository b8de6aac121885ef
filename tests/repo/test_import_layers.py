"""Imports go down the floors, never up: kernels and protos (1) < shared (2) < services (3)
< loadtest (4). A kernel or the gRPC contract imports nothing of shared or services; shared
(the engine, the wire module, the registry, ...) imports nothing of services; nothing but
loadtest imports loadtest. Tests are no floor: they import anything.

The graph is test_import_cycles.py's (every import, at module level or in a function,
relative ones resolved, `if TYPE_CHECKING:` left out)."""
from __future__ import annotations

from tests.repo.test_import_cycles import import_graph, source_modules

FLOORS = {"kernels": 1, "protos": 1, "shared": 2, "services": 3, "loadtest": 4}


def floor(module: str) -> int:
    return FLOORS[module.split(".")[0]]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
            for a in sorted(graph) for b in sorted(graph[a]) if floor(b) > floor(a)]


def test_every_source_folder_has_a_floor():
    assert {m.split(".")[0] for m in source_modules()} == set(FLOORS)


def test_the_check_finds_a_planted_upward_import():
    graph = {"protos.codec": {"shared.engine.sampling_params"}, "shared.engine.sampling_params": set(),
             "services.gateway": {"shared.wire", "protos.codec"}, "shared.wire": {"protos.codec"},
             "kernels.op": {"kernels.triton_op"}, "kernels.triton_op": set()}
    assert upward_imports(graph) == ["protos.codec (floor 1) imports shared.engine.sampling_params (floor 2)"]


def test_no_module_imports_from_a_higher_floor():
    found = upward_imports(import_graph(source_modules()))
    assert not found, "imports up the floors (move the code down, or the import up):\n" + "\n".join(found)
