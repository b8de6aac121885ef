"""A setting, declared once on its dataclass field: `setting(...)` puts a `Setting` in the
field's metadata; `nested(...)` marks a field that holds another settings dataclass.

    @dataclass
    class EngineConfig:
        page_size: int = setting(16, flag="--page-size", env="DUET_PAGE_SIZE", help="tokens per KV page")

The flag (flags.py), the variable (its value is the flag's default), `duet env` (catalog.py)
and the dataclass built back from parsed flags all come from that one declaration."""
from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

from shared.settings import parsers

SETTING = "duet.setting"  # field metadata keys
NESTED = "duet.nested"


class SettingError(ValueError):
    """A value that does not parse, naming where it came from (flag or variable)."""


@dataclass(frozen=True)
class Setting:
    flag: str | None          # "--page-size"; None: environment only (e.g. a secret kept off argv)
    env: str | None           # "DUET_PAGE_SIZE"; None: flag only
    help: str
    parse: Callable[[str], Any]
    default: Any              # what the field gets with neither flag nor variable
    choices: tuple[str, ...] = ()
    off_flags: tuple[str, ...] = ()  # older spellings that turn a bool off, e.g. "--disable-cuda-graph"
    repeat: bool = False      # a list: each flag adds one item to the variable's items
    env_in_code: bool = False  # the variable also sets the field when the dataclass is built in code
    # not for users: set by Duet for its own processes, or a knob kept so experiments (benchmarks)
    # can compare its values; its flag is hidden from --help and `duet env` lists it apart
    internal: bool = False
    secret: bool = False      # never print its value

    @property
    def is_bool(self) -> bool:
        return self.parse is parsers.boolean

    @property
    def type_label(self) -> str:
        return "|".join(self.choices) if self.choices else parsers.label(self.parse)

    def from_text(self, text: str, source: str) -> Any:
        try:
            value = self.parse(text)
        except ValueError as exc:
            shown = "***" if self.secret else repr(text)
            raise SettingError(f"{source}={shown}: {exc}") from None
        if self.choices and value not in self.choices:
            raise SettingError(f"{source}={text!r}: choose one of {', '.join(self.choices)}")
        return value

    def coerce(self, value: Any, name: str) -> Any:
        """A value given in code (EngineConfig(pdl="on"), Engine(**options)): text goes through
        the parser as a flag's would, then the choices apply; SettingError names the field and flag."""
        where = f"{name}={'***' if self.secret else repr(value)}" + (f" ({self.flag})" if self.flag else "")
        if isinstance(value, str) and self.parse is not str:
            try:
                value = self.parse(value)
            except ValueError as exc:
                raise SettingError(f"{where}: {exc}") from None
        if self.choices and value not in self.choices and not (value is None and self.default is None):
            raise SettingError(f"{where}: choose one of {', '.join(self.choices)}")
        return value

    def env_value(self, env: Mapping[str, str]) -> Any:
        """The variable's value, or MISSING when unset (an empty value counts as unset)."""
        text = env.get(self.env, "") if self.env else ""
        return self.from_text(text, self.env) if text.strip() else MISSING

    def value(self, env: Mapping[str, str]) -> Any:
        """The variable's value, else the default (a fresh copy of a list or dict)."""
        found = self.env_value(env)
        if found is not MISSING:
            return found
        if isinstance(self.default, (list, tuple)) and self.repeat:
            return list(self.default)
        return copy.copy(self.default) if isinstance(self.default, dict) else self.default


@dataclass(frozen=True)
class Nested:
    cls: type
    title: str = ""  # a --help section of its own; "" = with the enclosing fields


def setting(default: Any = None, *, flag: str | None = None, env: str | None = None, help: str,
            parse: Callable[[str], Any] | None = None, choices: tuple[str, ...] = (),
            off_flags: tuple[str, ...] = (), repeat: bool = False, env_in_code: bool = False,
            internal: bool = False, secret: bool = False) -> Any:
    """A dataclass field declared as a setting. parse: text -> value (default: from the
    default's type: bool, int, float, else str). repeat: a list field, the flag repeatable."""
    if flag is None and env is None:
        raise ValueError("a setting needs a flag, a variable or both")
    if parse is None:
        parse = parsers.boolean if isinstance(default, bool) else type(default) if isinstance(
            default, (int, float)) else parsers.words if repeat else str
    spec = Setting(flag=flag, env=env, help=help, parse=parse, default=list(default or ()) if repeat else default,
                   choices=tuple(choices), off_flags=tuple(off_flags), repeat=repeat, env_in_code=env_in_code,
                   internal=internal, secret=secret)
    metadata = {SETTING: spec}
    if env_in_code:
        return dataclasses.field(default_factory=lambda: _code_default(spec), metadata=metadata, repr=not secret)
    if repeat or isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: copy.copy(spec.default), metadata=metadata,
                                 repr=not secret)
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


def _code_default(spec: Setting) -> Any:
    found = spec.env_value(os.environ)
    return copy.copy(spec.default) if found is MISSING else found


def check_values(obj: Any) -> None:
    """Parse and check the values a settings dataclass was given in code, as its flags would
    be (Setting.coerce), in place; nested settings dataclasses too. Call from __post_init__."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if NESTED in f.metadata:
            check_values(value)
        elif SETTING in f.metadata:
            checked = f.metadata[SETTING].coerce(value, f.name)
            if checked is not value:
                object.__setattr__(obj, f.name, checked)


def nested(cls: type, title: str = "") -> Any:
    """A field holding another settings dataclass (its flags join this one's)."""
    return dataclasses.field(default_factory=cls, metadata={NESTED: Nested(cls, title)})


def walk(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Setting]]:
    """(field path, Setting) for every setting of cls and of the dataclasses it nests."""
    for f in dataclasses.fields(cls):
        if NESTED in f.metadata:
            yield from walk(f.metadata[NESTED].cls, path + (f.name,))
        elif SETTING in f.metadata:
            yield path + (f.name,), f.metadata[SETTING]


def find(cls: type, name: str) -> Setting:
    """The setting of cls's field `name` (a dotted path reaches nested ones)."""
    for path, spec in walk(cls):
        if ".".join(path) == name:
            return spec
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


@dataclass(frozen=True)
class Variable:
    """A DUET_* variable read outside any settings dataclass (a process-wide path, a
    handshake between Duet's own processes), with the commands that read it."""

    setting: Setting
    read_by: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.setting.env

    def get(self, env: Mapping[str, str] | None = None) -> Any:
        return self.setting.value(os.environ if env is None else env)


def variable(env: str, default: Any = None, *, help: str, read_by: tuple[str, ...],
             parse: Callable[[str], Any] = str, internal: bool = False, choices: tuple[str, ...] = ()) -> Variable:
    return Variable(Setting(flag=None, env=env, help=help, parse=parse, default=default, choices=tuple(choices),
                            internal=internal), tuple(read_by))
