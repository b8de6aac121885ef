"""SamplingParams (shared/engine/sampling_params.py) <-> duet_pb2.SamplingParams, grammar
included: the gateway sends, the prefill and decode workers receive.

Sending refuses what the contract cannot carry (ContractOverflow, naming the field) instead
of letting protobuf raise mid-request or wrap a value silently. Receiving turns the wire's
zero values back into the engine's defaults (0 = unset)."""
from __future__ import annotations

from protos import duet_pb2
from shared.engine.grammar_spec import GrammarSpec
from shared.engine.sampling_params import SamplingParams
from shared.wire.contract_overflow import ContractOverflow, float32, int32, seed_to_uint64

_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def sampling_to_proto(params: SamplingParams) -> duet_pb2.SamplingParams:
    """Raises ContractOverflow for a value the contract cannot carry."""
    if params.min_tokens:
        raise ContractOverflow("min_tokens", params.min_tokens, "0 over gRPC (the contract has no such field)")
    floats = {name: float32(name, getattr(params, name)) for name in _FLOATS}
    bias = {int32("logit_bias", token): float32("logit_bias", value)
            for token, value in (params.logit_bias or {}).items()}
    msg = duet_pb2.SamplingParams(
        **floats, top_k=int32("top_k", params.top_k), max_tokens=int32("max_tokens", params.max_tokens or 0),
        stop=list(params.stop), stop_token_ids=[int32("stop_token_ids", t) for t in params.stop_token_ids],
        ignore_eos=params.ignore_eos, logprobs=params.logprobs is not None,
        top_logprobs=int32("top_logprobs", params.logprobs or 0), n=int32("n", params.n), logit_bias=bias)
    if params.seed is not None:
        msg.seed = seed_to_uint64(params.seed)
    if params.grammar is not None:
        msg.grammar.kind, msg.grammar.text = params.grammar.kind, params.grammar.text
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = int32("prompt_logprobs", params.prompt_logprobs)
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
