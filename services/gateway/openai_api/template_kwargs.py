"""`chat_template_kwargs` from a request: an allow-list of keys (ChatTemplateConfig), each a
plain value. Never a template (`chat_template`) or anything else that is code: a client's
Jinja would replace the model's prompt format and run on our machine."""
from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from shared.openai_protocol.errors import InvalidRequest

ALWAYS = ("add_generation_prompt",)  # a render switch of ours, not the template's
MAX_TEXT_CHARS = 1024
MAX_INT = 1 << 31


def checked_template_kwargs(kwargs: dict[str, Any] | None, allowed: Collection[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (kwargs or {}).items():
        param = f"chat_template_kwargs.{key}"
        if key == "chat_template":
            raise InvalidRequest("a request cannot supply a chat template: this server renders prompts only "
                                 "with the model's own", param)
        if key not in allowed and key not in ALWAYS:
            accepted = ", ".join(sorted({*allowed, *ALWAYS}))
            raise InvalidRequest(f"`{key}` is not a chat template option this server accepts "
                                 f"(accepted: {accepted})", param)
        _check_value(value, key, param)
        out[key] = value
    return out


def _check_value(value: Any, key: str, param: str) -> None:
    if key in ALWAYS and not isinstance(value, bool):
        raise InvalidRequest(f"`{key}` must be a boolean", param)
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise InvalidRequest(f"`{key}` must be within ±2^31", param)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest(f"`{key}` must be a finite number", param)
    elif isinstance(value, str):
        if len(value) > MAX_TEXT_CHARS:
            raise InvalidRequest(f"`{key}` is longer than {MAX_TEXT_CHARS} characters", param)
    else:
        raise InvalidRequest(f"`{key}` must be a boolean, a number, a string or null", param)
