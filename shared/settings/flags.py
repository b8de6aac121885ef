"""argparse flags from settings dataclasses, and the dataclass built back from parsed flags.

A flag's default is its DUET_* variable's value when set (else the declared default), so the
order is: flag, then variable, then default. Bools get `--x/--no-x`; a nested dataclass's
flags join the parser (in a --help section of their own when the field gives a title). An
internal setting's flag is accepted but hidden from --help."""
from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from shared.settings.spec import NESTED, SETTING, Setting, SettingError, find

T = TypeVar("T")


def build_parser(cls: type, env: Mapping[str, str] | None = None, **parser_kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(**parser_kwargs)
    add_flags(parser, cls, env)
    return parser


def parse_argv(cls: type[T], argv: Sequence[str] | None, env: Mapping[str, str] | None = None,
               **parser_kwargs) -> T:
    """cls from command-line flags and DUET_* variables (argv None: sys.argv[1:])."""
    return from_args(cls, build_parser(cls, env, **parser_kwargs).parse_args(argv))


def add_flags(parser: argparse.ArgumentParser, cls: type, env: Mapping[str, str] | None = None,
              *, _path: tuple[str, ...] = (), _group=None) -> None:
    env = os.environ if env is None else env
    for f in dataclasses.fields(cls):
        if NESTED in f.metadata:
            sub = f.metadata[NESTED]
            group = parser.add_argument_group(sub.title) if sub.title else _group
            add_flags(parser, sub.cls, env, _path=_path + (f.name,), _group=group)
        elif SETTING in f.metadata:
            _add_setting(parser, _group or parser, f.metadata[SETTING], ".".join(_path + (f.name,)), env)


def _add_setting(parser: argparse.ArgumentParser, target, spec: Setting, dest: str, env: Mapping[str, str]) -> None:
    try:
        default = spec.value(env)
    except SettingError as exc:
        parser.error(f"environment variable {exc}")
    if spec.flag is None:  # environment only
        parser.set_defaults(**{dest: default})
        return
    kwargs: dict[str, Any] = {"dest": dest, "default": default}
    if spec.is_bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif spec.repeat:
        kwargs.update(action="append", metavar=_metavar(spec))
    else:
        kwargs.update(type=_flag_parser(spec), metavar=_metavar(spec))
    action = target.add_argument(spec.flag, **kwargs)
    # after: BooleanOptionalAction appends its own default; an internal flag is taken, not shown
    action.help = argparse.SUPPRESS if spec.internal else help_text(spec, env)
    for off in spec.off_flags:
        target.add_argument(off, dest=dest, action="store_false",
                            help=argparse.SUPPRESS if spec.internal else f"same as --no-{spec.flag[2:]}")


def help_text(spec: Setting, env: Mapping[str, str]) -> str:
    """The declared help, then where the value comes from: `[env DUET_X; default: V]`."""
    notes = []
    if spec.env:
        text = env.get(spec.env, "")
        notes.append(f"env {spec.env}" + (f"={'***' if spec.secret else text}" if text.strip() else ""))
    shown = format_value(spec.default)
    if shown and not spec.secret:
        notes.append(f"default: {shown}")
    return f"{spec.help} [{'; '.join(notes)}]".replace("%", "%%") if notes else spec.help.replace("%", "%%")


def format_value(value: Any) -> str:
    """A value as flags and variables spell it ("" for none)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _metavar(spec: Setting) -> str:
    return "{" + ",".join(spec.choices) + "}" if spec.choices else spec.flag.lstrip("-").upper().replace("-", "_")


def _flag_parser(spec: Setting):
    def parse(text: str):
        value = spec.parse(text)  # a ValueError: argparse's "invalid <type> value" message
        if spec.choices and value not in spec.choices:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(spec.choices)})")
        return value
    parse.__name__ = spec.type_label
    return parse


def from_args(cls: type[T], args: argparse.Namespace, *, _path: tuple[str, ...] = ()) -> T:
    """cls (and the dataclasses it nests) from a namespace add_flags' parser filled."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if NESTED in f.metadata:
            kwargs[f.name] = from_args(f.metadata[NESTED].cls, args, _path=_path + (f.name,))
        elif SETTING in f.metadata:
            kwargs[f.name] = getattr(args, ".".join(_path + (f.name,)))
    return cls(**kwargs)


def env_value(cls: type, name: str, env: Mapping[str, str] | None = None) -> Any:
    """One setting's value from the environment alone (its variable, else its default)."""
    return find(cls, name).value(os.environ if env is None else env)
