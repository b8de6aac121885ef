"""The engine's outputs (shared/engine/outputs.StepOutput) <-> the messages that carry them:
Token (a token, its logprob and alternatives), TokenChunk (Decode.Generate's stream),
PrefillReply and SequenceStart (Prefill's first tokens), GenerateRequest's first tokens.
The workers send, the gateway receives and decodes back into StepOutputs.

What the contract does not keep: "error" travels as FINISH_REASON_ABORT (it comes back as
"abort"); a token's logprob travels as float32 and only when the request asked for
logprobs (a None logprob arrives as 0.0); prompt logprobs travel for prompt tokens 1..
(position 0 has none), so a one-token prompt's come back as None."""
from __future__ import annotations

from dataclasses import dataclass

from protos import duet_pb2
from shared.engine.outputs import StepOutput

_FINISH_TO_PROTO = {None: duet_pb2.FINISH_REASON_UNSPECIFIED, "stop": duet_pb2.FINISH_REASON_STOP,
                    "length": duet_pb2.FINISH_REASON_LENGTH, "abort": duet_pb2.FINISH_REASON_ABORT,
                    "error": duet_pb2.FINISH_REASON_ABORT, "moved": duet_pb2.FINISH_REASON_MOVED}
_FINISH_FROM_PROTO = {duet_pb2.FINISH_REASON_STOP: "stop", duet_pb2.FINISH_REASON_LENGTH: "length",
                      duet_pb2.FINISH_REASON_ABORT: "abort", duet_pb2.FINISH_REASON_MOVED: "moved"}


@dataclass(frozen=True)
class Usage:
    """A request's token counts, on its last TokenChunk."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from a prefix cache


@dataclass
class PrefillAnswer:
    """What Prefill answers: every sequence's first output, index order (the first carries the
    prompt logprobs when asked), and what the prompt cost."""
    firsts: list[StepOutput]
    cached_tokens: int
    computed_tokens: int
    kv_bytes: int


# --- finish reasons and tokens -------------------------------------------------------------

def finish_to_proto(out: StepOutput) -> int:
    return _FINISH_TO_PROTO[out.finish_reason if out.finished else None]


def finish_from_proto(code: int) -> str | None:
    """"stop", "length", "abort", or None (not finished)."""
    return _FINISH_FROM_PROTO.get(code)


def _token(token_id: int, logprob: float | None, top) -> duet_pb2.Token:
    tok = duet_pb2.Token(id=token_id)
    if logprob is not None:
        tok.logprob = logprob
        for tid, tlp in top or []:
            tok.top_logprobs.add(token_id=tid, logprob=tlp)
    return tok


def tokens_to_proto(out: StepOutput) -> list[duet_pb2.Token]:
    n_lp, n_top = len(out.logprobs), len(out.top_logprobs)
    return [_token(tid, out.logprobs[i] if i < n_lp else None, out.top_logprobs[i] if i < n_top else None)
            for i, tid in enumerate(out.token_ids)]


def _top(tok: duet_pb2.Token) -> list[tuple[int, float]]:
    return [(a.token_id, a.logprob) for a in tok.top_logprobs]


def _from_tokens(tokens, rid: str, logprobs: bool, finish: int, index: int, **rest) -> StepOutput:
    reason = finish_from_proto(finish)
    return StepOutput(rid, [t.id for t in tokens], logprobs=[t.logprob for t in tokens] if logprobs else [],
                      top_logprobs=[_top(t) for t in tokens] if logprobs else [],
                      finished=reason is not None, finish_reason=reason, index=index, **rest)


def prompt_logprobs_to_proto(prompt_ids: list[int], entries: list | None) -> list[duet_pb2.Token]:
    """The engine's per-position prompt logprobs (position 0 has none) as Tokens for 1..L-1."""
    return [_token(prompt_ids[pos], entries[pos][0], entries[pos][1]) for pos in range(1, len(entries or []))]


def prompt_logprobs_from_proto(tokens) -> list | None:
    """Back into the engine's form: per prompt position, None for the first, else
    (logprob, [(token id, logprob), ...] best first); None when none came."""
    return [None] + [(t.logprob, _top(t)) for t in tokens] if tokens else None


# --- Decode.Generate's stream ----------------------------------------------------------------

def chunk_to_proto(out: StepOutput, prompt_ids: list[int], tokens: list[duet_pb2.Token] | None = None,
                   usage: Usage | None = None) -> duet_pb2.TokenChunk:
    """tokens: out's own unless given (several outputs of one sequence sent as one chunk);
    usage: on the request's last chunk (out.request_finished), and only there."""
    chunk = duet_pb2.TokenChunk(tokens=tokens_to_proto(out) if tokens is None else tokens,
                                finish_reason=finish_to_proto(out), index=out.index)
    if usage is not None:
        chunk.usage.CopyFrom(duet_pb2.Usage(prompt_tokens=usage.prompt_tokens,
                                            completion_tokens=usage.completion_tokens,
                                            cached_tokens=usage.cached_tokens))
    if out.prompt_logprobs is not None:
        chunk.prompt_logprobs.extend(prompt_logprobs_to_proto(prompt_ids, out.prompt_logprobs))
    return chunk


def chunk_from_proto(chunk: duet_pb2.TokenChunk, rid: str, logprobs: bool) -> tuple[StepOutput, Usage | None]:
    """logprobs: whether the request asked for them (otherwise the tokens carry none)."""
    usage = None
    if chunk.HasField("usage"):
        u = chunk.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    out = _from_tokens(chunk.tokens, rid, logprobs, chunk.finish_reason, chunk.index,
                       request_finished=usage is not None,
                       prompt_logprobs=prompt_logprobs_from_proto(chunk.prompt_logprobs))
    return out, usage


# --- Prefill's first tokens, and their way on to decode -------------------------------------

def prefill_reply_to_proto(answer: PrefillAnswer, prompt_ids: list[int]) -> duet_pb2.PrefillReply:
    first = answer.firsts[0]
    reply = duet_pb2.PrefillReply(cached_tokens=answer.cached_tokens, computed_tokens=answer.computed_tokens,
                                  kv_bytes_sent=answer.kv_bytes, finish_reason=finish_to_proto(first))
    reply.first_token.CopyFrom(tokens_to_proto(first)[0])
    for seq in answer.firsts:
        start = reply.sequences.add(finish_reason=finish_to_proto(seq))
        start.first_token.CopyFrom(tokens_to_proto(seq)[0])
    reply.prompt_logprobs.extend(prompt_logprobs_to_proto(prompt_ids, first.prompt_logprobs))
    return reply


def prefill_reply_from_proto(reply: duet_pb2.PrefillReply, rid: str, logprobs: bool) -> PrefillAnswer:
    """logprobs: whether the request asked for them."""
    starts = list(reply.sequences) or [duet_pb2.SequenceStart(first_token=reply.first_token,
                                                              finish_reason=reply.finish_reason)]
    firsts = [_from_tokens([s.first_token], rid, logprobs, s.finish_reason, i) for i, s in enumerate(starts)]
    firsts[0].prompt_logprobs = prompt_logprobs_from_proto(reply.prompt_logprobs)
    return PrefillAnswer(firsts, reply.cached_tokens, reply.computed_tokens, reply.kv_bytes_sent)


def first_tokens_to_proto(generate: duet_pb2.GenerateRequest, firsts: list[StepOutput]) -> None:
    """Hand prefill's first tokens on to decode, which checks them against the notice."""
    generate.first_token.CopyFrom(tokens_to_proto(firsts[0])[0])
    if len(firsts) > 1:
        generate.first_tokens.extend(tokens_to_proto(f)[0] for f in firsts)


def first_token_ids_from_proto(generate: duet_pb2.GenerateRequest) -> list[int]:
    """Every sequence's first token id, index order."""
    return [t.id for t in generate.first_tokens] or [generate.first_token.id]
