"""Compile a request's grammar before it reaches the engine thread: compiling can take a
while for a large schema, and a bad one is the client's error (INVALID_ARGUMENT, which the
gateway answers with a 400 naming the problem). The engine then finds it in the cache.

A grammar not compiled here before is first checked by the worker's GrammarGuard (size
limits, then a compile in a helper process with a time budget): a schema that would compile
for minutes is refused after the budget instead of holding a core of this worker. A slow
compile's result comes back from the helper; a quick one is compiled here again."""
from __future__ import annotations

import asyncio

import grpc

from shared.engine.grammar_spec import GrammarError


async def compile_ahead(ctx, params, context) -> None:
    spec = params.grammar
    if spec is None:
        return
    try:
        # the first use loads the tokenizer's vocabulary: off the event loop too
        if not await asyncio.to_thread(lambda: ctx.engine.grammars.cached(spec)):
            shipped = await ctx.grammar_guard.check(spec) if ctx.grammar_guard is not None else None
            if shipped is not None:
                await asyncio.to_thread(lambda: ctx.engine.grammars.adopt(spec, shipped))
            else:
                await asyncio.to_thread(lambda: ctx.engine.grammars.compile(spec))
    except (GrammarError, ValueError) as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
