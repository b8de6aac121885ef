"""No import circles between Duet's modules.

The graph is built from the source (ast), not by importing: every `import` and `from ...
import` in services/, shared/, kernels/, protos/ and loadtest/, at module level and inside
functions alike (a function-level import that closes a circle only moves the failure to the
first call). Imports under `if TYPE_CHECKING:` never run and are left out.

An edge goes to the module named: `from a.b import c` is an edge to `a.b.c` when that is a
module of ours, else to `a.b` (its __init__ defines `c`). Parent packages are not edges of
their own: Python runs `a/__init__.py` before `a.b`, but a package's __init__ that imports
its submodules (a re-export) is no circle unless a submodule imports the __init__ back for
a name it defines."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared", "kernels", "protos", "loadtest")

# Circles that exist and are owed a fix, each with what closes it. A new circle fails the test,
# and so does one listed here that is gone (take it off the list).
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node that can run (not under `if TYPE_CHECKING:`)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
                continue
            base = _base(module, path, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    edges.add(sub)
                elif base in modules:
                    edges.add(base)
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:  # iterative: no recursion limit on deep chains
        nonlocal counter
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def shortest_circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete circle through the component's first module, for the failure message."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return paths[node] + [start]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    nxt.append(child)
        frontier = nxt
    return component


def test_the_graph_sees_imports_of_every_kind():
    graph = import_graph(source_modules())
    # module level, absolute: the host imports the roles it installs
    assert "services.decode.role" in graph["services.worker.roles"]
    # inside a function: the worker's serve() imports the host once the flags parsed
    assert "services.worker.host" in graph["services.worker.main"]
    # relative, inside a function: the engine package's lazy names
    assert "shared.engine.engine" in graph["shared.engine"]
    # `from package import module` is an edge to the module
    assert "protos.duet_pb2" in graph["services.decode.service"]


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert shortest_circle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_cycles_between_modules():
    graph = import_graph(source_modules())
    found = cycles(graph)
    new = [c for c in found if tuple(c) not in KNOWN_CYCLES]
    assert not new, "import circles:\n" + "\n".join(" -> ".join(shortest_circle(graph, c)) for c in new)
    gone = [c for c in KNOWN_CYCLES if list(c) not in found]
    assert not gone, f"these circles are gone: take them off KNOWN_CYCLES: {gone}"
