"""An in-process engine behind the GenerationBackend interface (single process, tests).

The engine is single-threaded by design: one thread owns it, loads the model, and runs
`step()` while there is work; asyncio handlers talk to it through a command queue and
get each request's StepOutputs back through a per-request asyncio.Queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from services.gateway.backend import (
    FINISH_REASONS,
    BackendBadRequest,
    BackendUnavailable,
    GenerationRequest,
    SamplingOptions,
    TokenEvent,
    TokenLogprob,
)

log = logging.getLogger("duet.gateway.local")


def engine_sampling_params(options: SamplingOptions):
    """Our SamplingOptions as the engine's SamplingParams (vLLM-style logprobs count)."""
    from shared.engine import SamplingParams

    return SamplingParams(
        temperature=options.temperature, top_p=options.top_p, top_k=options.top_k, min_p=options.min_p,
        seed=options.seed, max_tokens=options.max_tokens, stop=list(options.stop),
        stop_token_ids=list(options.stop_token_ids), ignore_eos=options.ignore_eos,
        repetition_penalty=options.repetition_penalty, frequency_penalty=options.frequency_penalty,
        presence_penalty=options.presence_penalty,
        logprobs=options.top_logprobs if options.logprobs else None, n=options.n,
        logit_bias=options.logit_bias, grammar=options.grammar, prompt_logprobs=options.prompt_logprobs,
    )


@dataclass
class LocalBackend:
    """engine_factory builds the engine (loads the model) on the engine thread."""

    engine_factory: Callable[[], Any]
    name: str = "local"
    expected_context_len: int = 0  # reported before the engine has loaded
    idle_wait_s: float = 0.05
    engine: Any = field(default=None, init=False)
    load_error: BaseException | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[Any], None]] = {}  # engine thread only
        self._stop = threading.Event()
        self._loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-engine", daemon=True)
        self._crashed = False

    # --- GenerationBackend ---------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.name

    @property
    def max_context_len(self) -> int:
        return self.engine.max_model_len if self.engine is not None else self.expected_context_len

    def ready(self) -> bool:
        return self._loaded.is_set() and self.engine is not None and not self._crashed

    async def start(self) -> None:
        self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, 30)

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps (inspection, tests)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run(engine) -> None:
            try:
                future.set_result(fn(engine))
            except BaseException as exc:
                future.set_exception(exc)

        self._commands.put(run)
        return future

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (or failed to); True when ready."""
        self._loaded.wait(timeout)
        return self.ready()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if not self.ready():
            raise BackendUnavailable("the model is still loading" if self.load_error is None
                                     else f"the model failed to load: {self.load_error}")
        params = engine_sampling_params(request.sampling)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        rid = request.request_id

        def deliver(item) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        def add(engine) -> None:
            try:
                engine.add_request(list(request.prompt_token_ids), params, rid)
            except ValueError as exc:  # the engine's checks (length, vocabulary, KV capacity, grammar)
                loop.call_soon_threadsafe(_settle, added, exc)
                return
            self._sinks[rid] = deliver
            loop.call_soon_threadsafe(_settle, added, None)

        if params.grammar is not None:  # compile off the engine thread (a bad one: 400)
            try:
                await asyncio.to_thread(lambda: self.engine.grammars.compile(params.grammar))
            except ValueError as exc:
                raise BackendBadRequest(str(exc)) from None
        self._commands.put(add)
        finished = False
        try:
            error = await added
            if error is not None:
                raise BackendBadRequest(str(error))
            while True:
                out = await outputs.get()
                if out.finish_reason is not None and out.finish_reason not in FINISH_REASONS:
                    finished = out.request_finished  # the engine already dropped it
                    raise BackendUnavailable(out.error or f"the engine ended the request ({out.finish_reason})")
                event = TokenEvent(
                    token_ids=list(out.token_ids),
                    logprobs=_logprobs(out) if params.logprobs is not None else None,
                    finish_reason=out.finish_reason if out.finished else None,
                    cached_tokens=out.num_cached_tokens,
                    computed_tokens=out.num_prompt_tokens - out.num_cached_tokens,
                    index=out.index,
                    prompt_logprobs=_prompt_logprobs(request.prompt_token_ids, out.prompt_logprobs),
                )
                if out.request_finished:
                    finished = True
                yield event
                if finished:
                    return
        finally:
            if not finished:
                # Closed early (stop string matched, client left) or cancelled: free the
                # request's pages and batch slot now. Harmless if it just finished.
                self._commands.put(lambda engine: self._abort(engine, rid))

    # --- engine thread ---------------------------------------------------------------------

    def _abort(self, engine, rid: str) -> None:
        self._sinks.pop(rid, None)
        engine.abort(rid)

    def _run(self) -> None:
        try:
            self.engine = self.engine_factory()
        except BaseException as exc:  # reported through ready() and generate()
            log.exception("engine failed to load")
            self.load_error = exc
            self._loaded.set()
            return
        self._loaded.set()
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain(engine, block=not engine.has_work)
                if engine.has_work and not self._stop.is_set():
                    for out in engine.step():
                        sink = self._sinks.get(out.rid)
                        if sink is not None:
                            sink(out)
                        if out.request_finished:
                            self._sinks.pop(out.rid, None)
        except BaseException as exc:  # never leave handlers waiting on a dead engine
            log.exception("engine loop crashed")
            self._crashed = True
            from shared.engine.outputs import StepOutput

            for rid, sink in list(self._sinks.items()):
                sink(StepOutput(rid, [], finished=True, finish_reason="error", error=f"engine failed: {exc}",
                                request_finished=True))
            self._sinks.clear()

    def _drain(self, engine, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            command(engine)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)


def _prompt_logprobs(prompt_ids, entries) -> list[TokenLogprob] | None:
    """The engine's per-position prompt logprobs (position 0 has none), for tokens 1.."""
    if entries is None:
        return None
    return [TokenLogprob(prompt_ids[pos], lp, [(int(t), float(v)) for t, v in top])
            for pos, (lp, top) in enumerate(entries[1:], start=1)]


def _logprobs(out) -> list[TokenLogprob]:
    result = []
    for i, token_id in enumerate(out.token_ids):
        # OpenAI's value for "unknown / very unlikely"; NaN is not valid JSON.
        logprob = out.logprobs[i] if i < len(out.logprobs) and out.logprobs[i] is not None else -9999.0
        top = out.top_logprobs[i] if i < len(out.top_logprobs) else []
        result.append(TokenLogprob(token_id, logprob, [(int(t), float(lp)) for t, lp in top]))
    return result

