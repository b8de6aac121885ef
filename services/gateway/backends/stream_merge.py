"""Several async streams as one: the sequences of an n > 1 request that moved to other
workers each continue as a stream of their own (migration.py)."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, TypeVar

T = TypeVar("T")


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of every stream as they come. The first stream to fail ends the whole (the others
    are cancelled, so each runs its own cleanup); so does closing or cancelling the merge."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((False, item))
        except Exception as exc:
            queue.put_nowait((True, exc))
            return
        queue.put_nowait((True, None))

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            ended, value = await queue.get()
            if not ended:
                yield value
            elif value is not None:
                raise value
            else:
                left -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
