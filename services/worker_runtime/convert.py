"""Engine outputs -> proto, shared by the worker services (sampling parameters travel
through protos/sampling_codec.py, the one converter pair the gateway uses too)."""
from __future__ import annotations

from protos import duet_pb2
from shared.engine.cache_scope import CacheScope
from shared.engine.outputs import StepOutput

FINISH = {None: duet_pb2.FINISH_REASON_UNSPECIFIED, "stop": duet_pb2.FINISH_REASON_STOP,
          "length": duet_pb2.FINISH_REASON_LENGTH, "abort": duet_pb2.FINISH_REASON_ABORT,
          "error": duet_pb2.FINISH_REASON_ABORT}


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


def cache_scope(request) -> CacheScope:
    """The prefix-cache namespace and tenant a Reserve, Prefill or Generate request carries."""
    return CacheScope(namespace=request.cache_namespace, tenant=request.tenant)
