"""Request bodies of POST /v1/chat/completions and /v1/completions.

pydantic checks the shape and JSON types (strict: "0.5" is not a number, 1 is not a
boolean); `check()` then checks ranges and combinations with messages that name the
parameter, as OpenAI's API does. Unknown fields are ignored (as vLLM does), so
clients that send newer OpenAI fields keep working. Extensions follow vLLM's names:
top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, chat_template_kwargs,
cache_salt (a string that keeps the request's prefix cache apart from requests without it).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from protos.wire_ranges import FLOAT32_MAX, INT32_MAX, SEED_MAX, SEED_MIN
from shared.openai_protocol.errors import InvalidRequest
from shared.openai_protocol.tools import check_response_format, check_tool_choice, check_tools

MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_BATCH_CHOICES = 1024  # prompts x n in one completions request (vLLM has no cap; one request must stay bounded)
MAX_CACHE_SALT_CHARS = 1024
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # ASCII digits only: "²" is a digit to str.isdigit, not to int()
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Union member names pydantic puts into an error's location; not part of the param path.
_LOC_NOISE = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before"}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _SamplingFields(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extensions (the openai client sends them through extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _check_sampling(self) -> None:
        _range("temperature", self.temperature, 0.0, 2.0)
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _range("min_p", self.min_p, 0.0, 1.0)
        if self.top_k is not None and not -1 <= self.top_k <= INT32_MAX:
            raise InvalidRequest(f"top_k must be -1 or 0 (off) or between 1 and {INT32_MAX}, got {self.top_k}",
                                 "top_k")
        if self.repetition_penalty is not None and not 0.0 < self.repetition_penalty <= FLOAT32_MAX:
            raise InvalidRequest(f"repetition_penalty must be > 0 (and finite), got {self.repetition_penalty}",
                                 "repetition_penalty")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        _range("max_tokens", self.max_tokens, 1, INT32_MAX)
        _range("seed", self.seed, SEED_MIN, SEED_MAX)
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
        for i, stop in enumerate(self.stop_list):
            if stop == "":
                raise InvalidRequest("stop strings must not be empty", f"stop[{i}]" if isinstance(self.stop, list) else "stop")
        for i, token_id in enumerate(self.stop_token_ids or []):
            if not 0 <= token_id <= INT32_MAX:
                raise InvalidRequest(f"stop_token_ids must be token ids (0 to {INT32_MAX}), got {token_id}",
                                     f"stop_token_ids[{i}]")
        self.token_bias()  # raises on bad keys or values
        check_cache_salt(self.cache_salt)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with token-id keys ("50256" -> 50256), values checked (-100..100)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID_KEY.fullmatch(key) or int(key) > INT32_MAX:
                raise InvalidRequest(f"logit_bias keys must be token ids (0 to {INT32_MAX} in ASCII digits), "
                                     f"got {key!r}", "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise InvalidRequest(f"logit_bias values must be between -100 and 100, got {value}", "logit_bias")
            out[int(key)] = float(value)
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def completion_limit(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens, as in OpenAI's API."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0

    def check(self) -> None:
        self._check_sampling()
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise InvalidRequest(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}",
                                 "max_completion_tokens")
        _range("max_completion_tokens", self.max_completion_tokens, 1, INT32_MAX)
        if not self.messages:
            raise InvalidRequest("messages must contain at least one message", "messages")
        for i, message in enumerate(self.messages):
            _check_message(message, f"messages[{i}]")
        if self.top_logprobs is not None:
            _range("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
            if self.top_logprobs > 0 and not self.logprobs:
                raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        check_tools(self.tools)
        check_tool_choice(self.tool_choice, self.tools)
        check_response_format(self.response_format)
        if self.response_format and self.response_format.get("type") != "text" and \
                self.effective_tool_choice not in ("none", "auto"):
            raise InvalidRequest("response_format cannot be combined with a forced tool_choice", "response_format")

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates expect them: text content as one string."""
        out = []
        for message in self.messages:
            entry: dict[str, Any] = {"role": message.role, "content": _content_text(message.content)}
            for key in ("name", "tool_calls", "tool_call_id"):
                value = getattr(message, key)
                if value is not None:
                    entry[key] = value
            out.append(entry)
        return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        if self.echo and self.max_tokens == 0:  # echo alone (lm-eval's loglikelihood): no new token
            self.max_tokens, self._echo_only = 1, True
        self._check_sampling()
        if self.logprobs is not None:
            _range("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.best_of is not None and self.best_of != self.num_choices:
            raise InvalidRequest("best_of must equal n when given (this server returns every sequence)", "best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported by this server", "suffix")
        prompts = self.prompts()  # raises on a missing or empty prompt
        if len(prompts) * self.num_choices > MAX_BATCH_CHOICES:
            raise InvalidRequest(f"at most {MAX_BATCH_CHOICES} choices per request (prompts x n)", "prompt")

    _echo_only: bool = False

    @property
    def echo_only(self) -> bool:
        """max_tokens was 0 with echo: answer with the prompt alone."""
        return self._echo_only

    def prompts(self) -> list[str | list[int]]:
        """Every prompt (text or token ids); a single one is a list of one."""
        prompt = self.prompt
        if prompt is None:
            raise InvalidRequest("prompt is required", "prompt")
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        for i, one in enumerate(batch):
            param = f"prompt[{i}]" if len(batch) > 1 else "prompt"
            if len(one) == 0:
                raise InvalidRequest("prompt must not be empty", param)
            if isinstance(one, list) and any(t < 0 for t in one):
                raise InvalidRequest("prompt token ids must be non-negative", param)
        return batch


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    request = _parse(ChatCompletionRequest, body)
    request.check()
    return request


def parse_completion_request(body: bytes) -> CompletionRequest:
    request = _parse(CompletionRequest, body)
    request.check()
    return request


def _parse(model: type[BaseModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _as_invalid_request(exc) from None


def _as_invalid_request(exc: ValidationError) -> InvalidRequest:
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return InvalidRequest(f"The request body is not valid JSON: {first['msg']}")
    if first["type"] == "model_type" and not first["loc"]:
        return InvalidRequest("The request body must be a JSON object")
    param = _param_path(first["loc"])
    if first["type"] == "missing":
        return InvalidRequest(f"Missing required parameter: '{param}'", param)
    if param == "prompt":  # a union: pydantic reports the first member (str), which misleads
        return InvalidRequest("Invalid type for 'prompt': expected a string, an array of strings, an array of "
                              "token ids (integers) or an array of token-id arrays", param)
    return InvalidRequest(f"Invalid type for '{param}': {first['msg']}", param)


def _param_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _LOC_NOISE or "[" in str(part):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


def check_cache_salt(salt: str | None) -> None:
    """vLLM's rule (a non-empty string when given), and a bound on its length."""
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                             f"got {len(salt)}", "cache_salt")


def _range(name: str, value, low, high) -> None:
    if value is not None and not (low <= value <= high):
        raise InvalidRequest(f"{name} must be between {low} and {high}, got {value}", name)


def _check_message(message: ChatMessage, param: str) -> None:
    if message.role not in CHAT_ROLES:
        raise InvalidRequest(f"Invalid role {message.role!r}: expected one of {', '.join(CHAT_ROLES)}",
                             f"{param}.role")
    if isinstance(message.content, list):
        for j, part in enumerate(message.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                                     f"{param}.content[{j}]")
    if message.content is None and message.role != "assistant":
        raise InvalidRequest(f"Missing required parameter: '{param}.content'", f"{param}.content")
    for j, call in enumerate(message.tool_calls or []):
        _check_tool_call(call, f"{param}.tool_calls[{j}]")


def _check_tool_call(call: dict[str, Any], param: str) -> None:
    """An earlier answer's tool call, as OpenAI returns it: {"id", "type": "function",
    "function": {"name", "arguments": a JSON string}} (arguments as an object is taken too)."""
    if call.get("type", "function") != "function":
        raise InvalidRequest(f"only tool calls of type 'function' are supported, got {call.get('type')!r}",
                             f"{param}.type")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequest(f"Missing required parameter: '{param}.function'", f"{param}.function")
    if not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"Missing required parameter: '{param}.function.name'", f"{param}.function.name")
    if "arguments" not in fn:
        raise InvalidRequest(f"Missing required parameter: '{param}.function.arguments'",
                             f"{param}.function.arguments")
    if not isinstance(fn["arguments"], (str, dict)):
        raise InvalidRequest("tool call arguments must be a JSON string", f"{param}.function.arguments")


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)
