"""The generations of one HTTP request: one per prompt (a list of prompts in
/v1/completions), each with its n sequences, merged into one stream of deltas whose index
is the choice's: prompt index * n + sequence, as OpenAI numbers them. The generations run
concurrently; leaving early closes every one of them (each aborts its backend work)."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from dataclasses import dataclass
from typing import AsyncIterator

from services.gateway.openai_api.generation import Generation, GenerationStats, OutputDelta


@dataclass
class GenerationSet:
    generations: list[Generation]
    n: int = 1

    @property
    def stats(self) -> GenerationStats:
        """Usage summed over the prompts; finish reasons keyed by choice index."""
        parts = [g.stats for g in self.generations]
        total = GenerationStats(prompt_tokens=sum(p.prompt_tokens for p in parts),
                                completion_tokens=sum(p.completion_tokens for p in parts),
                                cached_tokens=sum(p.cached_tokens for p in parts))
        for k, p in enumerate(parts):
            for index, reason in p.finish_reasons.items():
                total.finish_reasons[k * self.n + index] = reason
            total.finish_reason = p.finish_reason or total.finish_reason
        firsts = [p.first_token_at for p in parts if p.first_token_at is not None]
        total.first_token_at = min(firsts) if firsts else None
        return total

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        if len(self.generations) == 1:
            async for delta in self.generations[0].deltas():
                yield delta
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(k: int, generation: Generation) -> None:
            try:
                async for delta in generation.deltas():
                    delta.index += k * self.n
                    await queue.put(delta)
                await queue.put(done)
            except BaseException as exc:  # handed to the consumer (cancellation included)
                await queue.put(exc)
                raise

        tasks = [asyncio.ensure_future(pump(k, g)) for k, g in enumerate(self.generations)]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
            for task in tasks:
                with suppress(BaseException):
                    await task
