"""Everything one `duet loadtest` invocation was asked to do, as plain data."""
from __future__ import annotations

import datetime
import pathlib
from dataclasses import asdict, dataclass, field


@dataclass
class SLO:
    """Per-request targets; a request is good when it finished and met every one set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


@dataclass
class EndpointConfig:
    base_url: str
    api: str = "chat"  # chat | completions
    model: str | None = None  # None: the first id /v1/models lists
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0
    temperature: float = 0.0
    # ignore_eos (a vLLM/SGLang extension) makes output lengths the workload's, not the
    # model's. auto: send it, and drop it if the server rejects the field.
    ignore_eos: str = "auto"  # auto | on | off
    extra_body: dict = field(default_factory=dict)
    lora_mix: dict[str, float] = field(default_factory=dict)  # model or LoRA adapter -> share of requests

    @property
    def http_headers(self) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**self.headers, **auth}

    @property
    def path(self) -> str:
        return "/chat/completions" if self.api == "chat" else "/completions"

    def to_json(self) -> dict:
        """For result files: never a secret."""
        d = asdict(self)
        del d["api_key"]
        return {**d, "headers": {k: "<redacted>" for k in self.headers}}


@dataclass
class WorkloadConfig:
    name: str = "sharegpt"  # sharegpt | random | shared-prefix | trace
    num_requests: int = 200
    seed: int = 0
    dataset_path: str | None = None  # ShareGPT JSON; None: the packaged copy
    sharegpt_output_len: int | None = None
    sharegpt_max_prompt_len: int = 1024
    sharegpt_max_total_len: int = 2048
    input_len: int = 512
    output_len: int = 128
    input_spread: float = 0.0
    output_spread: float = 0.0
    length_dist: str = "uniform"
    sp_groups: int = 4
    sp_system_len: int = 1024
    sp_question_len: int = 64
    sp_output_len: int = 128
    trace_path: str | None = None
    trace_time_unit: str = "s"
    trace_speedup: float = 1.0
    trace_block_size: int = 512


@dataclass
class LoadConfig:
    request_rates: list[float] = field(default_factory=lambda: [float("inf")])
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None  # stop sending after this long
    request_limit: int | None = None  # stop after this many sends; None: only --duration bounds
    warmup_requests: int = 1
    drain_timeout_s: float = 120.0  # after the last send, how long to wait for stragglers
    sweep_pause_s: float = 1.0


@dataclass
class OutputConfig:
    output_dir: str | None = None
    save_text: bool = False
    plots: bool = True
    progress: bool = True
    label: str | None = None

    def folder(self, name: str) -> pathlib.Path:
        """--output-dir, else ./loadtest-results/<time>-<name>."""
        stamped = pathlib.Path("loadtest-results") / f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{name}"
        return pathlib.Path(self.output_dir) if self.output_dir else stamped


@dataclass
class RunConfig:
    endpoint: EndpointConfig
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    slo: SLO = field(default_factory=SLO)
    output: OutputConfig = field(default_factory=OutputConfig)
    tokenizer: str | None = None

    def to_json(self) -> dict:
        d = {**asdict(self), "endpoint": self.endpoint.to_json()}
        d["load"]["request_rates"] = [r if r != float("inf") else "inf" for r in self.load.request_rates]
        return d
