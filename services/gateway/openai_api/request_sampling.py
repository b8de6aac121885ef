"""The engine's SamplingParams from a parsed OpenAI request, with the context rule applied.

SamplingParams (shared/engine/sampling_params.py, no torch) is the one sampling type from
here to the engine; shared/wire/sampling.py carries it over gRPC."""

from __future__ import annotations

from shared.admission.context_rule import completion_budget
from shared.engine.sampling_params import SamplingParams
from shared.openai_protocol.requests import ChatCompletionRequest, CompletionRequest
from shared.openai_protocol.responses import ResponsesRequest

# OpenAI's legacy completions endpoint (and vLLM) default to 16 new tokens.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_DEFAULTS = SamplingParams()


def _pick(value, default):
    return default if value is None else value


def _common(req, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=_pick(req.temperature, _DEFAULTS.temperature),
        top_p=_pick(req.top_p, _DEFAULTS.top_p),
        top_k=_pick(req.top_k, _DEFAULTS.top_k),
        min_p=_pick(req.min_p, _DEFAULTS.min_p),
        seed=req.seed,
        max_tokens=max_tokens,
        stop=req.stop_list,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        repetition_penalty=_pick(req.repetition_penalty, _DEFAULTS.repetition_penalty),
        frequency_penalty=_pick(req.frequency_penalty, _DEFAULTS.frequency_penalty),
        presence_penalty=_pick(req.presence_penalty, _DEFAULTS.presence_penalty),
        n=req.num_choices,
        logit_bias=req.token_bias(),
    )


def chat_sampling(req: ChatCompletionRequest, prompt_tokens: int, max_context: int) -> SamplingParams:
    max_tokens = completion_budget(req.completion_limit, None, prompt_tokens, max_context, "messages")
    params = _common(req, max_tokens)
    params.logprobs = req.num_top_logprobs if req.logprobs else None
    return params


def completion_sampling(req: CompletionRequest, prompt_tokens: int, max_context: int) -> SamplingParams:
    max_tokens = completion_budget(req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, prompt_tokens, max_context,
                                   "prompt")
    params = _common(req, max_tokens)
    params.logprobs = req.logprobs
    if req.echo and req.logprobs is not None:
        params.prompt_logprobs = req.logprobs
    return params


def responses_sampling(req: ResponsesRequest, prompt_tokens: int, max_context: int) -> SamplingParams:
    max_tokens = completion_budget(req.max_output_tokens, None, prompt_tokens, max_context, "input")
    return SamplingParams(temperature=_pick(req.temperature, _DEFAULTS.temperature),
                          top_p=_pick(req.top_p, _DEFAULTS.top_p), max_tokens=max_tokens)
