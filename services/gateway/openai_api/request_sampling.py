"""SamplingOptions from a parsed OpenAI request, with the context-length check."""

from __future__ import annotations

from services.gateway.backends.interface import SamplingOptions
from shared.openai_protocol.errors import InvalidRequest
from shared.openai_protocol.requests import ChatCompletionRequest, CompletionRequest

# OpenAI's legacy completions endpoint (and vLLM) default to 16 new tokens.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def completion_budget(requested: int | None, default: int | None, prompt_tokens: int, max_context: int,
                      prompt_param: str) -> int:
    """max_tokens to use, or InvalidRequest(code=context_length_exceeded) as OpenAI answers."""
    room = max_context - prompt_tokens
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {max_context} tokens. However, your prompt is "
            f"{prompt_tokens} tokens long, which leaves no room for a completion. Please reduce the "
            f"length of the {prompt_param}.", prompt_param, "context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_tokens + requested > max_context:
        raise InvalidRequest(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the {prompt_param}, {requested} in the "
            f"completion). Please reduce the length of the {prompt_param} or completion.",
            prompt_param, "context_length_exceeded")
    return requested


def _common(req, max_tokens: int) -> SamplingOptions:
    defaults = SamplingOptions()
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return SamplingOptions(
        temperature=pick(req.temperature, defaults.temperature),
        top_p=pick(req.top_p, defaults.top_p),
        top_k=pick(req.top_k, defaults.top_k),
        min_p=pick(req.min_p, defaults.min_p),
        seed=req.seed,
        max_tokens=max_tokens,
        stop=req.stop_list,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        repetition_penalty=pick(req.repetition_penalty, defaults.repetition_penalty),
        frequency_penalty=pick(req.frequency_penalty, defaults.frequency_penalty),
        presence_penalty=pick(req.presence_penalty, defaults.presence_penalty),
        n=req.num_choices,
        logit_bias=req.token_bias(),
    )


def chat_sampling(req: ChatCompletionRequest, prompt_tokens: int, max_context: int) -> SamplingOptions:
    max_tokens = completion_budget(req.completion_limit, None, prompt_tokens, max_context, "messages")
    options = _common(req, max_tokens)
    options.logprobs = bool(req.logprobs)
    options.top_logprobs = req.num_top_logprobs if req.logprobs else 0
    return options


def completion_sampling(req: CompletionRequest, prompt_tokens: int, max_context: int) -> SamplingOptions:
    max_tokens = completion_budget(req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, prompt_tokens, max_context,
                                   "prompt")
    options = _common(req, max_tokens)
    options.logprobs = req.logprobs is not None
    options.top_logprobs = req.logprobs or 0
    if req.echo and req.logprobs is not None:
        options.prompt_logprobs = req.logprobs
    return options
