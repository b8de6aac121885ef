"""The engine's StepOutputs as the HTTP layer's TokenEvents, for both backends: the local
one gets them from its engine, the gRPC one from the workers' messages (shared/wire)."""
from __future__ import annotations

from services.gateway.backends.interface import TokenEvent, TokenLogprob
from shared.engine.outputs import StepOutput


def token_event(out: StepOutput, prompt_ids: list[int], logprobs: bool, cached_tokens: int | None = None,
                computed_tokens: int | None = None) -> TokenEvent:
    """logprobs: whether the request asked for them."""
    return TokenEvent(token_ids=list(out.token_ids), logprobs=token_logprobs(out) if logprobs else None,
                      finish_reason=out.finish_reason if out.finished else None, cached_tokens=cached_tokens,
                      computed_tokens=computed_tokens, index=out.index,
                      prompt_logprobs=prompt_logprobs(prompt_ids, out.prompt_logprobs))


def prompt_logprobs(prompt_ids, entries) -> list[TokenLogprob] | None:
    """The engine's per-position prompt logprobs (position 0 has none), for tokens 1.."""
    if entries is None:
        return None
    return [TokenLogprob(prompt_ids[pos], lp, [(int(t), float(v)) for t, v in top])
            for pos, (lp, top) in enumerate(entries[1:], start=1)]


def token_logprobs(out: StepOutput) -> list[TokenLogprob]:
    result = []
    for i, token_id in enumerate(out.token_ids):
        # OpenAI's value for "unknown / very unlikely"; NaN is not valid JSON.
        logprob = out.logprobs[i] if i < len(out.logprobs) and out.logprobs[i] is not None else -9999.0
        top = out.top_logprobs[i] if i < len(out.top_logprobs) else []
        result.append(TokenLogprob(token_id, logprob, [(int(t), float(lp)) for t, lp in top]))
    return result
