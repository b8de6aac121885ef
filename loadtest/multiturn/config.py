"""Everything one `duet loadtest multiturn` invocation was asked to do, as plain data."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from loadtest.config import EndpointConfig, OutputConfig
from loadtest.multiturn.timing import ThinkTime

WORKLOADS = ("sharegpt", "synthetic", "agentic")
MODES = ("lockstep", "poisson")


@dataclass(frozen=True)
class WorkloadDefaults:
    """What a flag left unset means, per workload."""

    max_turns: int | None
    system_len: int | None
    output_len: int | None  # None: ShareGPT's reply lengths
    mode: str


DEFAULTS = {
    "sharegpt": WorkloadDefaults(max_turns=None, system_len=None, output_len=None, mode="poisson"),
    "synthetic": WorkloadDefaults(max_turns=4, system_len=5900, output_len=48, mode="lockstep"),
    "agentic": WorkloadDefaults(max_turns=8, system_len=2000, output_len=64, mode="poisson"),
}


@dataclass
class DialogWorkload:
    name: str = "synthetic"  # sharegpt | synthetic | agentic
    conversations: int = 16
    max_turns: int | None = None  # synthetic/agentic: the turns each has; sharegpt: a cap
    seed: int = 0
    dataset_path: str | None = None  # ShareGPT JSON; None: the packaged copy
    min_turns: int = 2  # sharegpt: skip shorter conversations
    output_len: int | None = None
    max_output_len: int | None = None  # sharegpt: cap on reply-derived lengths
    system_len: int | None = None  # synthetic: each conversation's own; agentic: the shared one
    user_len: int = 64  # synthetic: each user turn; agentic: the task
    tool_output_len: int = 300
    num_tools: int = 8

    def resolved(self) -> "DialogWorkload":
        """A copy with the workload's defaults filled in where a flag was left unset."""
        d = DEFAULTS[self.name]
        return DialogWorkload(**{**asdict(self),
                                 "max_turns": self.max_turns if self.max_turns is not None else d.max_turns,
                                 "system_len": self.system_len if self.system_len is not None else d.system_len,
                                 "output_len": self.output_len if self.output_len is not None else d.output_len})


@dataclass
class DialogArrivals:
    mode: str = "lockstep"  # lockstep: turn t of all at once; poisson: starts at a rate, think times
    conversation_rate: float = 1.0  # poisson: conversations started per second (inf: all at once)
    burstiness: float = 1.0
    think_time: ThinkTime = field(default_factory=ThinkTime)
    max_concurrency: int | None = None  # cap on requests in flight
    duration_s: float | None = None  # no turn is sent after this
    warmup_requests: int = 1


@dataclass
class MultiTurnConfig:
    endpoint: EndpointConfig
    workload: DialogWorkload = field(default_factory=DialogWorkload)
    arrivals: DialogArrivals = field(default_factory=DialogArrivals)
    output: OutputConfig = field(default_factory=OutputConfig)
    tokenizer: str | None = None
    max_context_tokens: int | None = None  # None: the server's max_model_len, if it says
    # Prometheus /metrics URLs read before the first lockstep round and after each: the
    # server's counters by turn (e.g. KV bytes a prefill worker sent at each turn)
    scrape_metrics: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = {**asdict(self), "endpoint": self.endpoint.to_json()}
        if d["arrivals"]["conversation_rate"] == float("inf"):
            d["arrivals"]["conversation_rate"] = "inf"
        return d
