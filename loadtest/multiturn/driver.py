"""Send conversations turn by turn: in lockstep rounds, or staggered (Poisson starts, think
times between turns). Each turn's messages are the history so far, answers included."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Callable

import httpx

from loadtest.config import EndpointConfig
from loadtest.multiturn.dialog import CONTEXT_LIMIT, ERROR, TIME_UP, DialogState
from loadtest.multiturn.timing import DialogTiming
from loadtest.multiturn.turn_record import TurnRecord
from loadtest.progress import Progress
from loadtest.records import RequestRecord
from loadtest.sse_client import PreparedRequest, build_body, send_streaming
from loadtest.tokenizer_source import TokenCounter


@dataclass
class TurnSender:
    """Builds and sends one turn's request, and keeps every turn's record."""

    client: httpx.AsyncClient
    url: str
    endpoint: EndpointConfig
    model: str
    counter: TokenCounter
    clock: Callable[[], float]
    max_context_tokens: int | None = None
    send_ignore_eos: bool = True
    keep_messages: bool = False
    gate: asyncio.Semaphore | None = None  # cap on requests in flight
    progress: Progress = field(default_factory=lambda: Progress(None, "turns", enabled=False))
    records: list[TurnRecord] = field(default_factory=list)

    def prepare(self, state: DialogState) -> PreparedRequest | None:
        """The next turn's request, or None (and the conversation ended) when prompt plus
        answer would pass the context limit."""
        messages = state.request_messages()
        tools = state.plan.tools
        prompt_len = self.counter.prompt_tokens(messages, None, tools)
        output_len = state.spec.output_len
        if self.max_context_tokens is not None and prompt_len + output_len > self.max_context_tokens:
            state.end(CONTEXT_LIMIT)
            return None
        body = build_body(self.endpoint, self.model, messages, None, output_len)
        if not self.send_ignore_eos:
            body.pop("ignore_eos", None)
        if tools:
            body["tools"] = tools
            # "none": answers in text even from models that would call tools; --extra-body may say otherwise
            body["tool_choice"] = self.endpoint.extra_body.get("tool_choice", "none")
        return PreparedRequest(body, prompt_len, output_len)

    async def send(self, state: DialogState, prepared: PreparedRequest, scheduled_at: float) -> TurnRecord:
        rec = RequestRecord(index=len(self.records), scheduled_at=scheduled_at, prompt_len=prepared.prompt_len,
                            max_tokens=prepared.max_tokens)
        turn = TurnRecord(state.plan.id, state.turn, rec, prepared.body["messages"] if self.keep_messages else None)
        self.records.append(turn)
        async with self.gate or contextlib.nullcontext():
            self.progress.started()
            try:
                await send_streaming(self.client, self.url, self.endpoint, prepared, rec, self.clock)
            finally:
                self.progress.finished(rec.ok)
        if rec.ok:
            state.accept(rec.output_text or "")
        else:
            state.end(ERROR)  # without an answer there is no next prompt to send
        return turn


async def run_lockstep(sender: TurnSender, states: list[DialogState], duration_s: float | None = None,
                       after_round=None) -> None:
    """Turn t of every live conversation at once; turn t + 1 when all of turn t are done.
    after_round: optional coroutine function called with each round's index once it ended
    (e.g. to read the server's counters between turns)."""
    round_index = 0
    while live := [s for s in states if s.active]:
        if duration_s is not None and sender.clock() >= duration_s:
            for s in live:
                s.end(TIME_UP)
            return
        ready = [(s, p) for s in live if (p := sender.prepare(s)) is not None]
        at = sender.clock()
        await asyncio.gather(*(sender.send(s, p, at) for s, p in ready))
        if after_round is not None:
            await after_round(round_index)
        round_index += 1


async def run_staggered(sender: TurnSender, states: list[DialogState], timings: list[DialogTiming],
                        duration_s: float | None = None) -> None:
    """Each conversation starts at its time and sends its next turn a think time after the
    previous answer ended."""

    async def one(state: DialogState, timing: DialogTiming) -> None:
        at = timing.start_at
        while state.active:
            if duration_s is not None and at >= duration_s:
                state.end(TIME_UP)
                return
            delay = at - sender.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            prepared = sender.prepare(state)
            if prepared is None:
                return
            turn = await sender.send(state, prepared, at)
            if state.active:
                at = turn.request.done_at + timing.think_s[turn.turn]

    await asyncio.gather(*(one(s, t) for s, t in zip(states, timings)))
