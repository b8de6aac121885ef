"""A request as the engine tracks it: tokens, pages, and how far its KV is computed."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .cache_scope import DEFAULT_SCOPE, CacheScope
from .radix_cache import RadixNode
from .sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages
    RUNNING = "running"  # prefilling (chunk by chunk) or decoding
    HELD = "held"  # prefill-only request done; pages kept until its KV transfer finishes
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    seed: int
    prefill_only: bool = False  # disaggregated prefill: stop after the first token, hold pages
    scope: CacheScope = DEFAULT_SCOPE  # the prefix-cache namespace it reads and fills, its tenant, its LoRA adapter
    lora_slot: int = -1  # the device slot of its LoRA adapter while it runs (-1: the base model)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    page_ids: list[int] = field(default_factory=list)  # page i holds tokens [i*ps, (i+1)*ps)
    num_computed: int = 0  # tokens whose KV is in the cache (cached_len), as of the launched steps
    # tokens whose KV the device has finished writing (prefill-only requests: what a KV
    # transfer may read; see Engine.poll_kv_ready)
    num_kv_ready: int = 0
    num_tree_pages: int = 0  # leading page_ids owned by the radix tree (shared, locked)
    prefix_node: RadixNode | None = None
    num_cached_tokens: int = 0  # prefix-cache hit at first admission (every tier)
    num_host_loaded_tokens: int = 0  # of those, tokens loaded back from the host tier
    kv_load_ticket: int | None = None  # the host tier's ticket of that load: scheduled once it landed
    continues: bool = False  # its prompt extends a sequence the cache held (a conversation's next turn)
    extends_finished: bool | None = None  # it holds a finished request's whole prompt (asked once)
    host_pages_waiting: int = 0  # matched pages still in the host tier (no device room to load them)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: str | None = None  # stop | length | abort | moved (hand_over) | error
    stop_reason: str | int | None = None
    error: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    # when a step first computed for it (the scheduler's clock, Req.arrival's), and the prefill
    # chunks scheduled (retracted work computed again included): a worker's queue and compute spans
    scheduled_at: float | None = None
    prefill_chunks: int = 0
    output_text: str = ""  # kept only when stop strings need it
    grammar: object = None  # GrammarState (grammar.py) of a constrained request
    index: int = 0  # sequence index within its request (n > 1)
    group: str | None = None  # the request's id when this is sequence index > 0 of it
    request_group: str = ""  # the client request it came from (a prompt list's prompts share it): fair turns
    forked: bool = False  # n > 1: the other sequences were made (at the first sample)
    forced_first: list[int] | None = None  # n > 1 recompute: the first tokens already sampled
    # output tokens that came with the request, sampled elsewhere (a recompute, a migrated
    # stream): the next sample is the first this worker makes
    num_given: int = 0
    prompt_lps: list | None = None  # prompt logprobs by position: (logprob, top) or None
    spec: object = None  # speculative/state.SpecState once it decodes with speculation on

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def out_rid(self) -> str:
        """The id outputs are reported under: the request's, for every sequence of it."""
        return self.group or self.rid

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def remaining(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.status is ReqStatus.RUNNING and self.remaining == 1 and self.num_output > 0

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED
