"""Many requests sharing a long system prompt: the case prefix caching and
prefix-aware routing are for. Groups of requests share one system prompt each."""
from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.workloads.request_spec import RequestSpec
from loadtest.workloads.synthetic_text import SyntheticText


@dataclass
class SharedPrefixShape:
    num_groups: int = 4
    system_prompt_len: int = 1024
    question_len: int = 64
    output_len: int = 128


def sample_shared_prefix(num: int, shape: SharedPrefixShape, text: SyntheticText, rng: random.Random) -> list[RequestSpec]:
    """`num` requests spread round-robin over the groups, then shuffled so one group's
    requests do not all arrive together."""
    systems = [text.text(shape.system_prompt_len) for _ in range(shape.num_groups)]
    out = [RequestSpec(user_text=text.text(shape.question_len), output_len=shape.output_len,
                       system_text=systems[i % shape.num_groups],
                       target_input_len=shape.system_prompt_len + shape.question_len) for i in range(num)]
    rng.shuffle(out)
    return out
