"""One forward step's worth of work, as the scheduler hands it to the model runner."""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Req


@dataclass
class ScheduledReq:
    req: Req
    start: int  # first position computed this step (== req.num_computed before the step)
    length: int  # tokens computed this step
    # speculative decoding: draft tokens verified after the request's last token (positions
    # start+1 ..); length is then 1 + len(draft) and every row samples
    draft: list[int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so it yields a new token."""
        return self.end == len(self.req.token_ids) or bool(self.draft)

    @property
    def all_rows(self) -> bool:
        """Every position's logits are wanted: prompt logprobs, computed once, where the
        prompt is computed (positions up to num_prompt - 2 predict prompt tokens)."""
        return self.req.params.prompt_logprobs is not None and self.start < self.req.num_prompt - 1


@dataclass
class Batch:
    items: list[ScheduledReq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.length for i in self.items)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token: the CUDA-graph-able shape."""
        return bool(self.items) and all(i.length == 1 for i in self.items)

    def __len__(self) -> int:
        return len(self.items)
