"""Failover the client never sees: when a worker serving a request fails, the gRPC backend
(grpc_workers.py) continues the request's open sequences on other workers, from the tokens
the client already has.

A continuation is an ordinary request through the split path, whose prompt is the original
prompt followed by the tokens already streamed (shared/wire/resume.py): the router places it
as any prompt (the prefill worker most likely still holds the prompt's pages, the new decode
worker may hold some), so its KV is rebuilt from what is held or moved before anything is
recomputed. The engine counts the streamed tokens as output and samples, keyed on
(seed, position), where the lost worker would have: greedy and seeded streams go on with the
tokens the unfaulted run makes. A sequence of an n > 1 request continues alone (n = 1, its
own seed: seed + index). The lost worker's instance is never chosen again for the request,
and the continuation runs on workers of the checkpoint the request began on.

`--migration-limit` bounds how often one sequence moves, `--migration-deadline` how long one
move may take to stream again; past either the client gets the error it would have got
without failover. (NVIDIA Dynamo's frontend migration replays the tokens so far the same way;
here the KV travels with the handoff instead of being recomputed, and the sampling keys make
the continuation exact.)"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from services.gateway.backends.interface import BackendUnavailable, GenerationRequest
from shared.engine.sampling_params import SamplingParams
from shared.settings.spec import setting
from shared.wire.resume import ResumedPrompt

# why a request moved: which RPC of its attempt failed, and whose failure it was
CAUSES = ("decode_stream",   # the decode worker's token stream broke, ended early or aborted
          "decode_reserve",  # the decode worker did not answer Reserve
          "kv_handoff",      # prefill could not write into the decode worker (decode gone)
          "prefill",         # the prefill worker failed or went away
          "handed_over")     # the decode worker handed the stream over (a role switch spreading its batch)
REBUILT_SOURCES = ("held", "moved", "recomputed")
MAX_HANDOVERS = 2  # hand-overs one sequence may take (each is a role switch of the worker it was on)


@dataclass
class MigrationConfig:
    limit: int = setting(3, flag="--migration-limit", env="DUET_MIGRATION_LIMIT",
                         help="times one sequence's stream may move to another worker after the worker serving "
                              "it failed; 0: no failover (the client gets the error)")
    deadline_s: float = setting(30.0, flag="--migration-deadline", env="DUET_MIGRATION_DEADLINE",
                                help="seconds one move may take, from the failure to the next token in hand; past it "
                                     "the client gets the error")

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"migration limit must be >= 0, got {self.limit}")
        if not self.deadline_s > 0:
            raise ValueError(f"migration deadline must be > 0 seconds, got {self.deadline_s}")


class WorkerLost(BackendUnavailable):
    """A worker of an attempt failed in a way another worker can make good: the request may
    move (cause: CAUSES; instance: the lost worker's instance nonce, never chosen again)."""

    def __init__(self, message: str, cause: str, worker_id: str, instance: str):
        super().__init__(message)
        self.cause, self.worker_id, self.instance = cause, worker_id, instance


@dataclass(frozen=True)
class Attempt:
    """One pass of a request (or of one of its sequences) through router and workers."""

    request_id: str                # this attempt's id on the router and workers
    prompt: ResumedPrompt          # the prompt, and the tokens the client has of this sequence
    sampling: SamplingParams
    indices: tuple[int, ...]       # the request's sequence index of each of this attempt's sequences
    moves: int = 0                 # how often this sequence moved so far
    handovers: int = 0             # of those, moves a worker asked for (handed_over), not failures
    exclude: tuple[str, ...] = ()  # instance nonces it lost
    exclude_decode: tuple[str, ...] = ()  # instances that handed it over: they may prefill it (they hold
                                          # its pages), not decode it
    checkpoint: str = ""           # the checkpoint it began on ("" on the first attempt)

    @classmethod
    def first(cls, request: GenerationRequest) -> "Attempt":
        return cls(request.request_id, ResumedPrompt(list(request.prompt_token_ids)), request.sampling,
                   tuple(range(request.sampling.n)))

    @property
    def resumed(self) -> bool:
        return self.moves > 0

    def may_move(self, lost: WorkerLost, limit: int) -> bool:
        """Whether it may move after `lost`: failures count against `--migration-limit`; a
        hand-over (a role switch spreading a batch) is no failure, so it moves even with failover
        off, at most MAX_HANDOVERS times a sequence."""
        if lost.cause == "handed_over":
            return self.handovers < MAX_HANDOVERS
        return self.moves - self.handovers < limit

    @property
    def remaining_tokens(self) -> int:
        """The completion budget left (0: up to the context length)."""
        total = self.sampling.max_tokens or 0
        return max(1, total - len(self.prompt.streamed)) if total else 0

    def moved(self, request: GenerationRequest, index: int, streamed: list[int], lost: WorkerLost,
              checkpoint: str) -> "Attempt":
        """The next attempt of sequence `index`, which streamed `streamed` before `lost`."""
        moves = self.moves + 1
        return Attempt(attempt_id(request, moves, (index,)),
                       ResumedPrompt(list(request.prompt_token_ids), list(self.prompt.streamed) + list(streamed)),
                       sequence_sampling(request.sampling, index), (index,), moves,
                       self.handovers + (lost.cause == "handed_over"), *self._excluding(lost),
                       checkpoint or self.checkpoint)

    def retried(self, request: GenerationRequest, lost: WorkerLost, checkpoint: str) -> "Attempt":
        """This attempt again, elsewhere: none of its tokens reached the client."""
        moves = self.moves + 1
        exclude, exclude_decode = self._excluding(lost)
        return dataclasses.replace(self, request_id=attempt_id(request, moves, self.indices), moves=moves,
                                   handovers=self.handovers + (lost.cause == "handed_over"), exclude=exclude,
                                   exclude_decode=exclude_decode, checkpoint=checkpoint or self.checkpoint)

    def _excluding(self, lost: WorkerLost) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(exclude, exclude_decode) after `lost`: a worker that failed is never chosen again; one
        that handed the stream over only never decodes it again."""
        if lost.cause == "handed_over":
            return self.exclude, self.exclude_decode + (lost.instance,)
        return self.exclude + (lost.instance,), self.exclude_decode

    def next_attempts(self, request: GenerationRequest, streams: "SequenceStreams", lost: WorkerLost,
                      checkpoint: str) -> list["Attempt"]:
        """What continues this attempt's open sequences after `lost`: the attempt again when
        the client has none of their tokens, else one attempt per sequence."""
        open_seqs = streams.open(self.indices)
        if len(open_seqs) == len(self.indices) and not any(streams.tokens.get(i) for i in open_seqs):
            return [self.retried(request, lost, checkpoint)]
        return [self.moved(request, i, streams.tokens.get(i, []), lost, checkpoint) for i in open_seqs]


def attempt_id(request: GenerationRequest, moves: int, indices: tuple[int, ...]) -> str:
    """The id an attempt has on router and workers: the request's at first, then marked with
    its move and, for one sequence of an n > 1 request, the sequence."""
    rid = request.request_id + (f"~m{moves}" if moves else "")
    return rid + (f".{indices[0]}" if len(indices) == 1 and request.sampling.n > 1 else "")


def sequence_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of a request on its own: n = 1 with the seed it draws with (seed +
    index); its prompt logprobs were sent with the first token already."""
    seed = sampling.child_seed(sampling.seed, index) if sampling.seed is not None and sampling.n > 1 else sampling.seed
    return dataclasses.replace(sampling, n=1, seed=seed, prompt_logprobs=None)


@dataclass(frozen=True)
class RebuiltTokens:
    """Where a continuation's KV came from, in tokens: held by the new decode worker already,
    moved from the prefill worker's cache, or computed again."""

    held: int = 0
    moved: int = 0
    recomputed: int = 0

    @classmethod
    def of_split(cls, total: int, held: int, computed: int) -> "RebuiltTokens":
        """total tokens of KV, held by decode (its reservation's held pages), computed by
        prefill (what its cache lacked; a page decode held and prefill computed counts once)."""
        held = min(held, total)
        recomputed = min(computed, total - held)
        return cls(held, total - held - recomputed, recomputed)

    @classmethod
    def of_local(cls, total: int, cached: int) -> "RebuiltTokens":
        """A continuation one worker prefilled itself: what it held, the rest computed."""
        held = min(cached, total)
        return cls(held, 0, total - held)

    def by_source(self) -> dict[str, int]:
        return {"held": self.held, "moved": self.moved, "recomputed": self.recomputed}


@dataclass
class SequenceStreams:
    """What the client got of each sequence of one attempt, by the request's sequence index."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def add(self, index: int, token_ids: list[int], finished: bool) -> None:
        self.tokens.setdefault(index, []).extend(token_ids)
        if finished:
            self.finished.add(index)

    def open(self, indices: tuple[int, ...]) -> list[int]:
        return [i for i in indices if i not in self.finished]
