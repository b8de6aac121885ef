"""Compile a request's grammar before it reaches the engine thread: compiling can take a
while for a large schema, and a bad one is the client's error (INVALID_ARGUMENT, which the
gateway answers with a 400 naming the problem). The engine then finds it in the cache."""
from __future__ import annotations

import asyncio

import grpc

from shared.engine.grammar import GrammarError


async def compile_ahead(ctx, params, context) -> None:
    if params.grammar is None:
        return
    try:
        await asyncio.to_thread(lambda: ctx.engine.grammars.compile(params.grammar))
    except (GrammarError, ValueError) as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
