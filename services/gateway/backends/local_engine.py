"""An in-process engine behind the GenerationBackend interface (single process, tests).

The engine runs on the worker's EngineLoop (services/worker_runtime/engine_loop.py): one thread
owns it and steps it while there is work; asyncio handlers submit closures to it and get
each request's StepOutputs through a per-request asyncio.Queue. The model loads on a
thread of its own so the server answers /health (503, loading) meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from services.gateway.backends.capacity import WorkerCapacity
from services.gateway.backends.interface import (
    FINISH_REASONS,
    AdapterNotFound,
    BackendBadRequest,
    BackendUnavailable,
    GenerationRequest,
    TokenEvent,
)
from services.gateway.backends.token_events import token_event
from services.worker_runtime.engine_loop import EngineLoop

log = logging.getLogger("duet.gateway.local")


@dataclass
class LocalBackend:
    """engine_factory builds the engine (loads the model) on a loader thread."""

    engine_factory: Callable[[], Any]
    name: str = "local"
    expected_context_len: int = 0  # reported before the engine has loaded
    idle_wait_s: float = 0.05
    engine: Any = field(default=None, init=False)
    load_error: BaseException | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._loop: EngineLoop | None = None
        self._lock = threading.Lock()  # start of the loop vs close()
        self._closed = False
        self._loaded = threading.Event()
        self._adapters: list[str] = []  # the engine's LoRA adapters, as of the last change (this thread's copy)
        self._loader = threading.Thread(target=self._load, name="gateway-engine-load", daemon=True)

    # --- GenerationBackend ---------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.name

    @property
    def max_context_len(self) -> int:
        return self.engine.max_model_len if self.engine is not None else self.expected_context_len

    def ready(self) -> bool:
        return (self._loaded.is_set() and not self._closed and self._loop is not None
                and self._loop.fatal is None)

    def live_capacity(self) -> list[WorkerCapacity]:
        engine = self.engine
        if engine is None:
            return []
        return [WorkerCapacity("both", engine.kv.capacity, engine.layout.page_size,
                               engine.config.max_running_requests, engine.scheduler.max_batched_tokens)]

    # --- LoRA adapters: the engine's, changed on its thread ------------------------------------

    def adapters(self) -> list[str]:
        return list(self._adapters)

    async def load_adapter(self, name: str, path: str, model: str | None = None) -> None:  # one model: its own
        from shared.engine.lora.adapter_files import LoraAdapterError
        lora = self._lora()
        try:
            await self._loop.acall(lambda: lora.load(name, path))
        except LoraAdapterError as exc:
            raise BackendBadRequest(str(exc), "lora_path") from None
        self._adapters = await self._loop.acall(lambda: lora.names)

    async def unload_adapter(self, name: str) -> None:
        lora = self._lora()
        if not await self._loop.acall(lambda: lora.unload(name)):
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        self._adapters = await self._loop.acall(lambda: lora.names)

    def _lora(self):
        if not self.ready():
            raise BackendUnavailable(self._unavailable_reason())
        if self.engine.lora is None:
            raise BackendBadRequest("this engine runs without LoRA slots (start it with --max-loras N)")
        return self.engine.lora

    async def start(self) -> None:
        self._loader.start()

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            loop = self._loop
        if loop is not None:
            await asyncio.to_thread(loop.stop, 30)

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps (inspection, tests)."""
        if self._loop is None:
            raise BackendUnavailable("the model is not loaded")
        return self._loop.call(lambda: fn(self.engine))

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (or failed to); True when ready."""
        self._loaded.wait(timeout)
        return self.ready()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if not self.ready():
            raise BackendUnavailable(self._unavailable_reason())
        loop, engine = self._loop, self.engine
        params = copy.deepcopy(request.sampling)  # the engine may set fields (seed); the caller's stays
        outputs: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        rid = request.request_id

        def add() -> int:
            prompt = list(request.prompt_token_ids)
            # the engine's cache, as the router's registry lookup is for the split stack: what this
            # prompt will not prefill (the admission then charges only the rest)
            held = 0 if params.prompt_logprobs is not None else \
                engine.kv.held_prefix_tokens(prompt[:-1], request.cache_scope.cache_key)
            engine.add_request(prompt, params, rid, scope=request.cache_scope, request_group=request.group)
            loop.attach(rid, aloop, outputs)
            return held

        if params.grammar is not None:  # compile off the engine thread (a bad one: 400)
            try:
                await asyncio.to_thread(lambda: engine.grammars.compile(params.grammar))
            except ValueError as exc:
                raise BackendBadRequest(str(exc)) from None
        try:
            held = await loop.acall_or_undo(add, lambda: (loop.detach(rid), engine.abort(rid)))
        except ValueError as exc:  # the engine's checks (length, vocabulary, KV capacity, grammar)
            raise BackendBadRequest(str(exc)) from None
        if request.on_routed is not None:
            request.on_routed(held, False)
        finished = False
        try:
            while True:
                out = await outputs.get()
                if out.finish_reason is not None and out.finish_reason not in FINISH_REASONS:
                    finished = out.request_finished  # the engine already dropped it
                    raise BackendUnavailable(out.error or f"the engine ended the request ({out.finish_reason})")
                event = token_event(out, request.prompt_token_ids, params.logprobs is not None,
                                    cached_tokens=out.num_cached_tokens,
                                    computed_tokens=out.num_prompt_tokens - out.num_cached_tokens)
                if out.request_finished:
                    finished = True
                yield event
                if finished:
                    return
        finally:
            if not finished:
                # Closed early (stop string matched, client left) or cancelled: free the
                # request's pages and batch slot now. Harmless if it just finished.
                loop.call(lambda: (loop.detach(rid), engine.abort(rid)))

    # --- loading ---------------------------------------------------------------------------

    def _unavailable_reason(self) -> str:
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self._loop is not None and self._loop.fatal is not None:
            return f"the engine failed: {self._loop.fatal}"
        if self._closed:
            return "the gateway is shutting down"
        return "the model is still loading"

    def _load(self) -> None:
        try:
            engine = self.engine_factory()
        except BaseException as exc:  # reported through ready() and generate()
            log.exception("engine failed to load")
            self.load_error = exc
            self._loaded.set()
            return
        with self._lock:
            if not self._closed:
                self.engine = engine
                self._adapters = engine.lora.names if engine.lora is not None else []
                self._loop = EngineLoop(engine, idle_wait_s=self.idle_wait_s)
                self._loop.start()
        self._loaded.set()

