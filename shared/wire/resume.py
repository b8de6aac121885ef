"""A migrated stream's tokens on the wire: PrefillRequest and GenerateRequest carry the
prompt followed by the completion tokens already streamed (`prompt_token_ids`, the tokens
whose KV the new workers rebuild) and how many of them are output
(`resumed_output_tokens`); the engine takes them apart again as a prompt and its
`output_prefix`, so max_tokens, penalties, the grammar's state and stop strings go on from
the tokens sent, and sampling, keyed on (seed, position), draws where the old worker would
have."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResumedPrompt:
    prompt: list[int]
    streamed: list[int] = field(default_factory=list)  # completion tokens the client already has

    @property
    def kv_tokens(self) -> list[int]:
        """Every token whose KV the request needs before its next sample."""
        return self.prompt + self.streamed

    def fields(self) -> dict:
        """The fields to set on a Prefill or Generate request."""
        return {"prompt_token_ids": self.kv_tokens, "resumed_output_tokens": len(self.streamed)}


def resumed_from_proto(request) -> ResumedPrompt:
    """A Prefill or Generate request's prompt and streamed tokens. Raises ValueError (->
    INVALID_ARGUMENT) when the count does not leave a prompt."""
    ids, k = list(request.prompt_token_ids), request.resumed_output_tokens
    if not 0 <= k < len(ids):
        raise ValueError(f"resumed_output_tokens {k} must leave a prompt of the {len(ids)} prompt_token_ids")
    return ResumedPrompt(ids[:len(ids) - k], ids[len(ids) - k:])
