"""The context rule: prompt + max_tokens must fit the model's context length.

One rule with OpenAI's wording (code `context_length_exceeded`), used at the gateway on every
prompt of a request and again by the engine when a request arrives at a worker."""
from __future__ import annotations

from shared.openai_protocol.errors import InvalidRequest

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def completion_budget(requested: int | None, default: int | None, prompt_tokens: int, max_context: int,
                      prompt_param: str = "prompt") -> int:
    """The max_tokens to use: `requested` when it fits, else InvalidRequest as OpenAI answers.
    Without one: `default` capped by the room left, or all of the room (default None)."""
    room = max_context - prompt_tokens
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {max_context} tokens. However, your prompt is "
            f"{prompt_tokens} tokens long, which leaves no room for a completion. Please reduce the "
            f"length of the {prompt_param}.", prompt_param, CONTEXT_LENGTH_EXCEEDED)
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_tokens + requested > max_context:
        raise InvalidRequest(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the {prompt_param}, {requested} in the "
            f"completion). Please reduce the length of the {prompt_param} or completion.",
            prompt_param, CONTEXT_LENGTH_EXCEEDED)
    return requested
