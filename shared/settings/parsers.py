"""Text -> value parsers shared by flags and DUET_* variables. Each has a label that --help and
`duet env` show as the setting's type."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def labelled(label: str):
    def mark(fn):
        fn.label = label
        return fn
    return mark


@labelled("bool")
def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(f"expected one of {'/'.join(TRUE + FALSE)}, got {text!r}")


@labelled("size")
def size(text: str) -> int:
    """'512M' / '4G' / '1048576' -> bytes."""
    value = text.strip().upper()
    if value and value[-1] in _SIZE_UNITS:
        return int(float(value[:-1]) * _SIZE_UNITS[value[-1]])
    return int(value or 0)


@labelled("size")
def optional_size(text: str) -> int | None:
    """A size where 0 means unset (the component picks)."""
    return size(text) or None


@labelled("size")
def size_text(text: str) -> str:
    """A size checked now but kept as written, for a command that passes it on."""
    size(text)
    return text.strip()


@labelled("int")
def optional_int(text: str) -> int | None:
    """An int where 0 means unset (the component picks)."""
    return int(text) or None


@labelled("float|auto")
def optional_float(text: str) -> float | None:
    """A number, or `auto` (unset: the component picks)."""
    return None if text.strip().lower() in ("", "auto") else float(text)


@labelled("list")
def words(text: str) -> list[str]:
    """Items separated by commas and/or spaces."""
    return text.replace(",", " ").split()


@labelled("text")
def one_item(text: str) -> list[str]:
    """A repeatable setting's variable holding one item (a path may hold commas or spaces)."""
    return [text.strip()]


@labelled("name=int,...")
def name_counts(text: str) -> dict[str, int]:
    """'o_proj=8, qkv_proj=2' -> {'o_proj': 8, 'qkv_proj': 2}: counts by name, each >= 0."""
    out: dict[str, int] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not item.strip():
            continue
        if not sep or not name.strip() or not value.strip().isdigit():
            raise ValueError(f"expected name=count pairs separated by commas, got {item.strip()!r}")
        out[name.strip()] = int(value)
    return out


def label(parse: Callable[[str], Any]) -> str:
    return getattr(parse, "label", None) or {int: "int", float: "float", str: "text"}.get(parse, parse.__name__)
