"""How hard the probes push and how long they may take (defaults: a 2-core CPU box running
`duet up` with the default model; the flags of `duet loadtest hostile` change them)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProbeSizes:
    probe_timeout_s: float = 30.0         # no probe runs longer (the runner cancels it)
    # 1: client Jinja
    jinja_loop: int = 10_000              # {% for i in range(N) %}{% for j in range(N) %} (N^2 steps)
    jinja_concurrency: int = 3            # such requests at once
    bomb_steps_mb: tuple[int, ...] = (30, 100, 300)  # "x" * (MB x 1e6), one after the other
    rss_cap_mb: float = 1500.0            # gateway RSS growth that cuts a probe short
    # 2: expensive schemas
    grammar_repeat: int = 8_000           # "[a-z]{1,N}" (15000, the size first reported: ~20 s a compile here)
    # 5: admission
    admission_prompts: int = 512
    admission_tokens: int = 32
    victim_lead_s: float = 1.0            # the attack's head start before the victim's request
    # 6: disconnects
    disconnect_requests: int = 10
    disconnect_prompt_words: int = 1100   # ~1 token each with the default model
    disconnect_after_s: float = 0.05      # the first client goes away this long after sending ...
    disconnect_stagger_s: float = 0.05    # ... and each next one this much later (50 ms to 500 ms)
    kv_watch_s: float = 30.0
    # 7: what can never fit, and a long list
    never_fit_n: int = 128
    never_fit_max_tokens: int = 2048
    big_list_prompts: int = 1024
    # related probes
    stop_strings: int = 20_000
    nesting_depth: int = 10_000
    settle_timeout_s: float = 30.0        # before each probe: wait for an idle stack, at most this


@dataclass
class SuiteConfig:
    base_url: str
    api_key: str | None = None
    gateway_pid: int | None = None
    redis_url: str | None = None
    worker_metrics: list[str] = field(default_factory=list)
    sizes: ProbeSizes = field(default_factory=ProbeSizes)
    only: list[str] = field(default_factory=list)  # probe names or checklist items ("1", "2", ...)
    skip: list[str] = field(default_factory=list)
    label: str = ""                                 # a word for the report ("split", "colocated")
