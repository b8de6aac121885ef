"""What the HTTP layer needs from whatever produces tokens.

Two implementations: GrpcBackend (grpc_workers.py: router -> Decode.Reserve -> Prefill ->
Decode.Generate, the disaggregated path) and LocalBackend (local_engine.py: an in-process
engine: tests, single process).

Contract of `generate`:
  * it is an async generator of TokenEvent; each of the request's n sequences (`index`)
    ends with an event carrying its finish_reason, and the generator ends after the last;
  * the caller may stop early (a stop string matched, the client left): it closes the
    generator (`aclose()`) or cancels the task iterating it; the backend must then
    release all work for the request (abort in the engine, cancel RPCs/reservation)
    in its `finally`, and never swallow asyncio.CancelledError;
  * refusals and failures are raised as the BackendError subclasses below, before or
    after the first event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, runtime_checkable

from services.gateway.backends.capacity import WorkerCapacity
from shared.engine.cache_scope import DEFAULT_SCOPE, CacheScope
from shared.engine.sampling_params import SamplingParams

FINISH_STOP = "stop"      # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context length reached
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # the engine's own type (no torch): one from the gateway to the engine
    model: str = ""
    # the client request it came from (a prompt list's prompts share it; "" = its own): the
    # workers' engines take waiting requests round robin across groups
    group: str = ""
    # W3C trace context (traceparent / tracestate) of the gateway's span, for RPC metadata.
    trace_context: dict[str, str] = field(default_factory=dict)
    # the prefix-cache namespace (tenant and cache_salt), tenant (http_edge/cache_namespace.py) and
    # the LoRA adapter the request runs with ("" = the base model; workers serving it are chosen)
    cache_scope: CacheScope = DEFAULT_SCOPE
    # told, once routed, the prompt tokens the chosen worker is expected to hold and whether a decode
    # worker prefills the rest (the admission then charges only what a prefill or `both` worker
    # prefills to its prefill budget: Grant.routed); None: nobody asks
    on_routed: Callable[[int, bool], None] | None = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class TokenEvent:
    """One or more new tokens. The last event of a request carries finish_reason."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when requested
    finish_reason: str | None = None            # FINISH_STOP or FINISH_LENGTH on the last event
    cached_tokens: int | None = None            # prompt tokens served from a prefix cache
    computed_tokens: int | None = None          # prompt tokens computed for this request
    index: int = 0                              # which sequence (n > 1); each ends with its finish_reason
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (echo), once, on index 0


class BackendError(Exception):
    """A backend could not serve a request; subclasses say how the client should see it."""


class BackendBusy(BackendError):
    """Admission refused after a bounded wait (no KV room): HTTP 429, retry later."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendUnavailable(BackendError):
    """No worker can serve now (none registered, worker died, stream broke): HTTP 503."""


class AdapterNotFound(BackendError):
    """No worker serves the LoRA adapter named: HTTP 404."""


class BackendBadRequest(BackendError):
    """A worker rejected the request's content (e.g. too long for its KV): HTTP 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@runtime_checkable
class GenerationBackend(Protocol):
    @property
    def model_name(self) -> str:
        """Name of the model the backend serves (informational; the gateway answers to
        its --served-model-name)."""

    @property
    def max_context_len(self) -> int:
        """Longest prompt + completion, in tokens."""

    def ready(self) -> bool:
        """True once the backend can serve a request (model loaded / workers found)."""

    def live_capacity(self, model: str | None = None) -> list[WorkerCapacity]:
        """What the live workers (of `model`, when given) hold (capacity.py); [] when unknown."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream the completion's tokens (see the module docstring for the contract)."""

    def adapters(self) -> list[str]:
        """The LoRA adapters clients may name as `model` now (sorted)."""

    async def load_adapter(self, name: str, path: str, model: str | None = None) -> None:
        """Serve LoRA adapter `name` from folder `path` on base model `model`'s workers (None: the
        default model's) (BackendBadRequest: a folder it cannot serve, or LoRA off;
        BackendUnavailable: no worker to load it on)."""

    async def unload_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter `name` (AdapterNotFound: nobody serves it)."""

    async def start(self) -> None:
        """Start background work (engine loop, registry watch); called once by the app."""

    async def close(self) -> None:
        """Stop background work and release resources; called once at shutdown."""
