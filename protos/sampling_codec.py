"""SamplingParams (shared/engine/sampling_params.py) <-> duet_pb2.SamplingParams: the one
converter pair, used by the gateway's gRPC backend and by the workers.

Sending refuses what the contract cannot carry (ContractOverflow, a ValueError naming the
field) instead of letting protobuf raise mid-request or wrap a value silently: int32 fields,
the uint64 seed (a negative seed down to -2**63 travels as its two's complement, which the
engine's generator reads the same), float fields finite in float32. Receiving turns the
wire's zero values back into the engine's defaults (0 = unset)."""
from __future__ import annotations

import math

from protos import duet_pb2
from protos.wire_ranges import FLOAT32_MAX, INT32_MAX, INT32_MIN, SEED_MAX, SEED_MIN
from shared.engine.grammar_spec import GrammarSpec
from shared.engine.sampling_params import SamplingParams



class ContractOverflow(ValueError):
    """A value the gRPC contract cannot carry; `field` names it (OpenAI's name where there is one)."""

    def __init__(self, field: str, value, what: str):
        super().__init__(f"{field} must be {what}, got {value!r}")
        self.field = field


def _int32(field: str, value: int) -> int:
    if not INT32_MIN <= value <= INT32_MAX:
        raise ContractOverflow(field, value, f"between {INT32_MIN} and {INT32_MAX}")
    return value


def _float32(field: str, value: float) -> float:
    if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise ContractOverflow(field, value, "a finite number (float32)")
    return value


def sampling_to_proto(params: SamplingParams) -> duet_pb2.SamplingParams:
    """Raises ContractOverflow for a value the contract cannot carry."""
    if params.min_tokens:
        raise ContractOverflow("min_tokens", params.min_tokens, "0 over gRPC (the contract has no such field)")
    floats = {name: _float32(name, getattr(params, name)) for name in
              ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")}
    bias = {_int32("logit_bias", token): _float32("logit_bias", value)
            for token, value in (params.logit_bias or {}).items()}
    msg = duet_pb2.SamplingParams(
        **floats, top_k=_int32("top_k", params.top_k), max_tokens=_int32("max_tokens", params.max_tokens or 0),
        stop=list(params.stop), stop_token_ids=[_int32("stop_token_ids", t) for t in params.stop_token_ids],
        ignore_eos=params.ignore_eos, logprobs=params.logprobs is not None,
        top_logprobs=_int32("top_logprobs", params.logprobs or 0), n=_int32("n", params.n), logit_bias=bias)
    if params.seed is not None:
        if not SEED_MIN <= params.seed <= SEED_MAX:
            raise ContractOverflow("seed", params.seed, f"between {SEED_MIN} and {SEED_MAX}")
        msg.seed = params.seed % (1 << 64)
    if params.grammar is not None:
        msg.grammar.kind, msg.grammar.text = params.grammar.kind, params.grammar.text
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = _int32("prompt_logprobs", params.prompt_logprobs)
    return msg


def sampling_from_proto(sp: duet_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (-> INVALID_ARGUMENT) for out-of-range values."""
    grammar = GrammarSpec(sp.grammar.kind, sp.grammar.text) if sp.HasField("grammar") else None
    return SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p or 1.0, top_k=sp.top_k if sp.top_k > 0 else -1,
        min_p=sp.min_p, seed=sp.seed if sp.HasField("seed") else None,
        max_tokens=sp.max_tokens or None, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos, repetition_penalty=sp.repetition_penalty or 1.0,
        frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
        logprobs=(sp.top_logprobs if sp.logprobs else None), n=sp.n or 1,
        logit_bias=dict(sp.logit_bias) or None, grammar=grammar,
        prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None)
