"""Pick and build the workload a run asked for."""
from __future__ import annotations

import random

from loadtest.config import WorkloadConfig
from loadtest.tokenizer_source import TokenCounter
from loadtest.workloads.random_lengths import LengthDistribution, sample_random
from loadtest.workloads.request_spec import RequestSpec
from loadtest.workloads.shared_prefix import SharedPrefixShape, sample_shared_prefix
from loadtest.workloads.sharegpt import ShareGPTFilter, load_conversations, sample_sharegpt
from loadtest.workloads.synthetic_text import SyntheticText
from loadtest.workloads.trace_replay import read_trace, trace_requests

WORKLOADS = ("sharegpt", "random", "shared-prefix", "trace")


def build_workload(cfg: WorkloadConfig, counter: TokenCounter) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    if cfg.name == "sharegpt":
        limits = ShareGPTFilter(fixed_output_len=cfg.sharegpt_output_len, max_prompt_len=cfg.sharegpt_max_prompt_len,
                                max_total_len=cfg.sharegpt_max_total_len)
        return sample_sharegpt(load_conversations(cfg.dataset_path), cfg.num_requests, counter, rng, limits)
    text = SyntheticText(counter, random.Random(cfg.seed + 1))
    if cfg.name == "random":
        return sample_random(cfg.num_requests, LengthDistribution(cfg.input_len, cfg.input_spread, cfg.length_dist),
                             LengthDistribution(cfg.output_len, cfg.output_spread, cfg.length_dist), text, rng)
    if cfg.name == "shared-prefix":
        shape = SharedPrefixShape(cfg.sp_groups, cfg.sp_system_len, cfg.sp_question_len, cfg.sp_output_len)
        return sample_shared_prefix(cfg.num_requests, shape, text, rng)
    if cfg.name == "trace":
        if not cfg.trace_path:
            raise SystemExit("--workload trace needs --trace FILE.jsonl")
        lines = read_trace(cfg.trace_path, cfg.trace_time_unit)
        return trace_requests(lines, text, cfg.trace_speedup, cfg.trace_block_size)
    raise SystemExit(f"unknown workload {cfg.name!r}; choose one of {', '.join(WORKLOADS)}")
