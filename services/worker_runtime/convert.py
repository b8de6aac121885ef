"""Proto <-> engine conversions shared by the worker services."""
from __future__ import annotations

from protos import duet_pb2
from shared.engine.grammar_spec import GrammarSpec
from shared.engine.outputs import StepOutput
from shared.engine.sampling_params import SamplingParams

FINISH = {None: duet_pb2.FINISH_REASON_UNSPECIFIED, "stop": duet_pb2.FINISH_REASON_STOP,
          "length": duet_pb2.FINISH_REASON_LENGTH, "abort": duet_pb2.FINISH_REASON_ABORT,
          "error": duet_pb2.FINISH_REASON_ABORT}


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


def tokens_to_proto(out: StepOutput, start: int = 0) -> list[duet_pb2.Token]:
    tokens = []
    for i in range(start, len(out.token_ids)):
        tok = duet_pb2.Token(id=out.token_ids[i])
        lp = out.logprobs[i] if i < len(out.logprobs) else None
        if lp is not None:
            tok.logprob = lp
            for tid, tlp in (out.top_logprobs[i] if i < len(out.top_logprobs) else []):
                tok.top_logprobs.add(token_id=tid, logprob=tlp)
        tokens.append(tok)
    return tokens


def prompt_logprobs_to_proto(prompt_ids: list[int], entries: list | None) -> list[duet_pb2.Token]:
    """The engine's per-position prompt logprobs (position 0 has none) as Tokens for 1..L-1."""
    out = []
    for pos in range(1, len(entries or [])):
        lp, top = entries[pos]
        tok = duet_pb2.Token(id=prompt_ids[pos], logprob=lp)
        for tid, tlp in top:
            tok.top_logprobs.add(token_id=tid, logprob=tlp)
        out.append(tok)
    return out
