"""The worker's folders import one way: the host (services/worker) imports the roles
(services/prefill, services/decode), which import what they share (services/worker_runtime);
never back."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def imported_modules(folder: str) -> dict[str, set[str]]:
    out = {}
    for path in (REPO / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        out[str(path.relative_to(REPO))] = names
    return out


def offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path} imports {name}" for path, names in imported_modules(folder).items() for name in sorted(names)
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_runtime_imports_no_host_and_no_role():
    assert not offenders("services/worker_runtime", ("services.worker", "services.prefill", "services.decode"))


def test_roles_do_not_import_the_host_or_each_other():
    assert not offenders("services/prefill", ("services.worker", "services.decode"))
    assert not offenders("services/decode", ("services.worker", "services.prefill"))
