"""The KV handoff's lifecycle tables (services/decode/reservation_state.py,
services/prefill/outgoing_state.py) and docs/ARCHITECTURE.md say the same thing:

  * every failure rule a move names is a row of section 4's table (by its short name), and
    that row lists the rule's moves exactly as the tables hold them;
  * every test a move cites, and every test section 4 cites, exists (file::function);
  * section 3 draws each table as a mermaid state diagram, move for move.

A failure prints the text the document should hold."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from services.decode.reservation_state import RESERVATION
from services.prefill.outgoing_state import OUTGOING

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs/ARCHITECTURE.md"
TABLES = {"decode": RESERVATION, "prefill": OUTGOING}  # the worker each lifecycle runs on
_TEST_ID = re.compile(r"(tests/[\w/.-]+\.py)?::(\w+)")


def mermaid(table) -> str:
    """The table as a mermaid stateDiagram-v2, one arrow per (from, to) with its events."""
    edges: dict[tuple[str, str], list[str]] = {}
    for m in table.moves.values():
        edges.setdefault((m.src.name, m.dst.name), []).append(m.event.name.lower())
    lines = ["stateDiagram-v2", f"    [*] --> {table.initial.name}"]
    lines += [f"    {src} --> {dst}: {', '.join(events)}" for (src, dst), events in edges.items()]
    lines += [f"    {s.name} --> [*]" for s in sorted(table.terminal, key=lambda s: s.name)]
    return "\n".join(lines)


def moves_text(rule: str) -> str:
    """The moves that serve `rule`, as section 4's table lists them ("" if none)."""
    parts = []
    for worker, table in TABLES.items():
        edges: dict[tuple[str, str], list[str]] = {}
        for m in table.moves.values():
            if m.rule == rule:
                edges.setdefault((m.src.name, m.dst.name), []).append(m.event.name.lower())
        if edges:
            moves = ", ".join(f"`{src} -{'/'.join(events)}-> {dst}`" for (src, dst), events in edges.items())
            parts.append(f"{worker}: {moves}")
    return "; ".join(parts)


@cache
def section(number: int) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {number}. ")
    return text[start:text.index("\n## ", start + 1)]


def rule_rows() -> dict[str, list[str]]:
    """Section 4's table: short name -> the row's cells (name, rule, where, moves, test)."""
    rows = {}
    for line in section(4).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            rows[cells[0].strip("`")] = cells
    return rows


def defines(path: str, name: str) -> bool:
    file = REPO / path
    if not file.is_file():
        return False
    tree = ast.parse(file.read_text())
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def test_every_rule_a_move_names_is_a_failure_rule():
    rows = rule_rows()
    assert len(rows) >= 18, "section 4's rows lost their short names"
    for worker, table in TABLES.items():
        unknown = sorted({m.rule for m in table.moves.values()} - set(rows))
        assert not unknown, f"{worker} lifecycle names rules section 4 lacks: {unknown}"


def test_section_4_lists_each_rules_moves():
    wrong = {}
    for name, cells in rule_rows().items():
        want = moves_text(name) or "none"
        if cells[3] != want:
            wrong[name] = want
    assert not wrong, "section 4's moves column should read:\n" + "\n".join(f"{k}: {v}" for k, v in wrong.items())


def test_every_test_a_move_or_a_rule_cites_exists():
    cited = {(t, f"{w} {m.src.name} -{m.event.name}->") for w, table in TABLES.items()
             for m in table.moves.values() for t in m.tests}
    for name, cells in rule_rows().items():
        path = None
        for file, function in _TEST_ID.findall(cells[4]):
            path = file or path  # "::name" goes on in the file named before it
            assert path, f"rule {name} cites ::{function} without a file"
            cited.add((f"{path}::{function}", f"rule {name}"))
    missing = sorted(f"{where}: {test}" for test, where in cited if not defines(*test.split("::")))
    assert not missing, "cited tests that do not exist:\n" + "\n".join(missing)


def test_section_3_draws_each_lifecycle():
    text = section(3)
    for worker, table in TABLES.items():
        diagram = mermaid(table)
        assert f"```mermaid\n{diagram}\n```" in text, f"section 3 should draw the {table.name} lifecycle:\n{diagram}"


def test_every_move_cites_a_test_and_every_state_is_reached():
    for table in TABLES.values():
        assert all(m.tests for m in table.moves.values())
        reached = {table.initial} | {m.dst for m in table.moves.values()}
        assert reached == set(type(table.initial)), f"{table.name}: states no move reaches"
