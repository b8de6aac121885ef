"""The generations of one HTTP request: one per prompt (a list of prompts in
/v1/completions), each with its n sequences, merged into one stream of deltas whose index
is the choice's: prompt index * n + sequence, as OpenAI numbers them. The generations run
concurrently, each once admission lets it (`admit(k)` returns a grant, told when that
generation's first token arrives and released when it ends: a long prompt list runs a share
at a time); leaving early closes every one of them (each aborts its backend work)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from services.gateway.openai_api.generation import Generation, GenerationStats, OutputDelta


@dataclass
class GenerationSet:
    generations: list[Generation]
    n: int = 1
    admit: Callable[[int], Awaitable[Any]] | None = None  # k -> a grant with release()

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

    async def _admitted(self, k: int) -> AsyncIterator[OutputDelta]:
        """Generation k's deltas once admitted; its grant learns of the first token (the
        prompt is prefilled) and is released at the end."""
        grant = await self.admit(k) if self.admit is not None else None
        routed = getattr(grant, "routed", None)  # the route lowers the grant's prefill charge
        if routed is not None:
            self.generations[k].request = replace(self.generations[k].request, on_routed=routed)
        try:
            async with aclosing(self.generations[k].deltas()) as deltas:  # closed now, not when collected
                async for delta in deltas:
                    if grant is not None:
                        grant.prefilled()
                    yield delta
        finally:
            if grant is not None:
                grant.release()

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        if len(self.generations) == 1:
            async with aclosing(self._admitted(0)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(k: int, generation: Generation) -> None:
            try:
                async with aclosing(self._admitted(k)) as deltas:
                    async for delta in deltas:
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
