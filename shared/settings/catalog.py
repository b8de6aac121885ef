"""The table of every DUET_* variable: gathered from the commands' settings dataclasses and the
loose variables (process_vars.py), one entry a variable whichever commands read it, with its
type, help, and each reader's default. `duet env` prints it (services/env_vars.py)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.settings.flags import format_value
from shared.settings.spec import Setting, Variable, walk


@dataclass(frozen=True)
class Reader:
    command: str          # "worker", "gateway", ...
    flag: str | None      # the command's flag for it (None: environment only)
    default: Any
    help: str


@dataclass
class EnvVar:
    name: str
    type: str
    help: str  # the first reader's; each reader keeps its own
    internal: bool = False
    secret: bool = False
    in_code: bool = False  # also read when the dataclass is built in code (offline API, benchmarks)
    readers: list[Reader] = field(default_factory=list)

    def default_for(self, command: str) -> Any:
        return next(r.default for r in self.readers if r.command == command)

    @property
    def defaults(self) -> dict[str, list[str]]:
        """Shown default -> the commands that have it (one key when they agree)."""
        out: dict[str, list[str]] = {}
        for r in self.readers:
            out.setdefault("" if self.secret else format_value(r.default), []).append(r.command)
        return out


def collect(commands: Sequence[tuple[str, type]], variables: Iterable[Variable] = (),
            also_read: Mapping[str, Sequence[str]] | None = None) -> dict[str, EnvVar]:
    """commands: (command name, its settings dataclass); also_read: variable -> more commands
    that read it through another's declaration (e.g. `duet up` reading the workers' DUET_TP).
    Raises ValueError when two declarations of one variable disagree on its type."""
    table: dict[str, EnvVar] = {}

    def add(spec: Setting, command: str) -> None:
        entry = table.get(spec.env)
        if entry is None:
            entry = table[spec.env] = EnvVar(spec.env, spec.type_label, spec.help, spec.internal, spec.secret,
                                             spec.env_in_code)
        elif entry.type != spec.type_label:
            raise ValueError(f"{spec.env} is a {entry.type} for {entry.readers[0].command} "
                             f"but a {spec.type_label} for {command}")
        entry.secret = entry.secret or spec.secret
        entry.in_code = entry.in_code or spec.env_in_code
        if all(r.command != command for r in entry.readers):
            entry.readers.append(Reader(command, spec.flag, spec.default, spec.help))

    for command, cls in commands:
        for _, spec in walk(cls):
            if spec.env:
                add(spec, command)
    for var in variables:
        for command in var.read_by:
            add(var.setting, command)
    for name, more in (also_read or {}).items():
        entry = table[name]
        first = entry.readers[0]
        entry.readers += [Reader(c, None, first.default, first.help) for c in more if all(r.command != c for r in entry.readers)]
    return dict(sorted(table.items()))


def render(table: Mapping[str, EnvVar], env: Mapping[str, str] | None = None, *, internal: bool = True) -> str:
    """Plain text, one block a variable, the internal ones last under a heading of their own;
    with env, the values set now (secrets masked)."""
    public = [_block(var, env) for var in table.values() if not var.internal]
    hidden = [_block(var, env) for var in table.values() if var.internal] if internal else []
    if hidden:
        public.append("\n" + INTERNAL_HEADING)
    return "\n".join(public + hidden) + "\n"


INTERNAL_HEADING = ("Internal: set by Duet for its own processes, or knobs kept so experiments can compare "
                    "their values (flags hidden from --help):")


def _block(var: EnvVar, env: Mapping[str, str] | None) -> str:
    notes = [var.type, "read by " + ", ".join(r.command for r in var.readers)]
    flags = sorted({r.flag for r in var.readers if r.flag})
    if var.internal and flags:
        notes.append("flag " + ", ".join(flags))
    if var.in_code:
        notes.append("also in code (offline API, benchmarks)")
    lines = [f"{var.name}  ({'; '.join(notes)})"]
    helps: dict[str, list[str]] = {}
    for r in var.readers:
        helps.setdefault(r.help, []).append(r.command)
    lines += [f"    {text}" if len(helps) == 1 else f"    {', '.join(cmds)}: {text}" for text, cmds in helps.items()]
    defaults = var.defaults
    shown = [f"{value or 'none'} ({', '.join(cmds)})" for value, cmds in defaults.items()]
    if not var.secret:
        lines.append("    default: " + (next(iter(defaults)) or "none" if len(defaults) == 1 else "; ".join(shown)))
    if env is not None and env.get(var.name, "").strip():
        lines.append(f"    set now: {'***' if var.secret else env[var.name]}")
    return "\n".join(lines)


def as_json(table: Mapping[str, EnvVar]) -> list[dict]:
    return [{"name": v.name, "type": v.type, "help": v.help, "internal": v.internal, "in_code": v.in_code,
             "readers": [{"command": r.command, "flag": r.flag,
                          "default": None if v.secret else format_value(r.default) or None, "help": r.help}
                         for r in v.readers]}
            for v in table.values()]
