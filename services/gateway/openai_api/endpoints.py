"""The OpenAI endpoints: parse, tokenize, run one Generation, answer as JSON or SSE."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST

from services.gateway.backends.capacity import (
    WorkerCapacity,
    batch_capacity,
    check_fits_some_worker,
    prefill_capacity,
)
from services.gateway.backends.interface import BackendError, GenerationBackend, GenerationRequest
from services.gateway.http_edge.admission import (
    AdmissionQueue,
    AdmissionRefused,
    Budget,
    Grant,
    Ticket,
    Work,
)
from services.gateway.http_edge.admission_metrics import register_admission_metrics
from services.gateway.http_edge.cache_namespace import CacheNamespaces
from services.gateway.http_edge.error_responses import (
    APIError,
    from_backend_error,
    from_invalid_request,
    internal_error,
    model_not_found,
    server_busy,
)
from services.gateway.http_edge.limits_config import GatewayLimits
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.http_edge.sse import (
    DONE_EVENT,
    ClientDisconnected,
    EventStreamResponse,
    run_until_disconnect,
    sse_event,
)
from services.gateway.openai_api.chat_objects import ChatFormatter
from services.gateway.openai_api.completion_objects import CompletionFormatter, EchoPrompt
from services.gateway.openai_api.generation import Generation, OutputDelta
from services.gateway.openai_api.generation_set import GenerationSet
from services.gateway.openai_api.prompt_builder import PromptBuilder
from services.gateway.openai_api.request_sampling import chat_sampling, completion_sampling, responses_sampling
from services.gateway.openai_api.responses_objects import ResponsesFormatter
from services.gateway.openai_api.stream_span import StreamTimes
from services.gateway.openai_api.served_model import ModelFiles, ServedModel
from services.gateway.openai_api.structured_outputs import checked, response_format_grammar, tool_choice_grammar
from services.gateway.openai_api.template_config import ChatTemplateConfig
from services.gateway.openai_api.template_kwargs import checked_template_kwargs
from services.gateway.openai_api.tool_call_parsing import ToolMode
from shared.admission.kv_demand import kv_demand
from shared.engine.grammar_limits import GrammarLimits
from shared.engine.sampling_params import SamplingParams
from shared.openai_protocol.errors import InvalidRequest
from shared.openai_protocol.requests import parse_chat_request, parse_completion_request
from shared.openai_protocol.responses import parse_responses_request
from shared.openai_protocol.tools import named_choice
from shared.telemetry.propagation import extract_http_context, inject_http_headers
from shared.telemetry.requests import HTTP_CLIENT_CLOSED

log = logging.getLogger("duet.gateway")

ENDPOINT_CHAT = "chat_completions"
ENDPOINT_COMPLETIONS = "completions"
ENDPOINT_RESPONSES = "responses"
# Status for requests whose client went away (nginx's 499: client closed request).
STATUS_CANCELLED = HTTP_CLIENT_CLOSED


@dataclass
class GatewayContext:
    """Everything a request needs, built once at start (no module globals). The positional
    fields describe the default model (the one a request that names none gets); extra_models
    are the other base models served behind the same router (served_model.py)."""

    backend: GenerationBackend
    prompts: PromptBuilder
    metrics: GatewayMetrics
    served_model_name: str
    max_context_len: int
    tracer: Any = field(default_factory=lambda: trace.get_tracer("duet-gateway"))
    created: int = field(default_factory=lambda: int(time.time()))
    tool_call_parser: str = "auto"  # auto | hermes | llama3_json | none (GatewayConfig)
    limits: GatewayLimits = field(default_factory=GatewayLimits)
    template: ChatTemplateConfig = field(default_factory=ChatTemplateConfig)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)
    # whose prompts share prefix-cache pages (main.py gives the configured key; else random)
    cache_namespaces: CacheNamespaces = field(default_factory=CacheNamespaces.random)
    lora_loading: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_admin.py)
    extra_models: list[ModelFiles] = field(default_factory=list)

    def __post_init__(self) -> None:
        lim = self.limits
        self.admission = AdmissionQueue(lim.max_concurrent, lim.max_queued, lim.queue_timeout_s, lim.retry_after_s,
                                        budget=self.admission_budget, max_request_share=lim.max_request_share,
                                        aging_s=lim.admission_aging_s, pools=lambda: list(self.models))
        register_admission_metrics(self.metrics.registry, self.admission)
        if hasattr(self.backend, "admission_backlog"):  # the router's overflow rule weighs what waits here
            self.backend.admission_backlog = self.admission.waiting_prompt_tokens_of
        default = ServedModel(self.served_model_name, self.prompts, self.max_context_len, self.template,
                              self.grammar, self.tool_call_parser)
        self.models: dict[str, ServedModel] = {default.name: default}
        for files in self.extra_models:
            if files.name in self.models:
                raise ValueError(f"two models are served under the name {files.name!r}")
            self.models[files.name] = ServedModel.of(files, self.template, self.grammar, self.tool_call_parser)
        self.default_model = default
        # the default model's (tests and helpers that know one model read these)
        self.token_strings, self.tool_template = default.token_strings, default.tool_template
        self.renderer, self.grammar_guard = default.renderer, default.grammar_guard

    def stop_helpers(self) -> None:
        """Stop every model's helper processes (a later request starts them again)."""
        for model in self.models.values():
            model.stop_helpers()

    def adapters(self) -> list[str]:
        """The LoRA adapters a request may name as `model` (the backend's; optional for stand-ins)."""
        return sorted(self.adapter_parents())

    def adapter_parents(self) -> dict[str, str]:
        """Each LoRA adapter and the base model it runs on (the model its workers serve); a
        backend that does not say (one model) runs them all on the default model."""
        parents = getattr(self.backend, "adapter_parents", None)
        if parents is not None:
            return {name: base for name, base in parents().items() if base in self.models}
        adapters = getattr(self.backend, "adapters", None)
        return {name: self.served_model_name for name in (adapters() if adapters is not None else [])}

    def resolve_model(self, model: str | None) -> tuple[ServedModel, str]:
        """The base model and LoRA adapter a request's `model` names ("" for a base model; a
        request that names none gets the default model, as vLLM's); a name nobody serves is a
        404 model_not_found."""
        if model is None:
            return self.default_model, ""
        if model in self.models:
            return self.models[model], ""
        parent = self.adapter_parents().get(model)
        if parent is not None:
            return self.models[parent], model
        raise model_not_found(model)

    def live_capacity(self, model: str | None = None) -> list[WorkerCapacity]:
        """What the live workers (of `model`, when given) can hold."""
        capacity = getattr(self.backend, "live_capacity", None)  # optional for stand-in backends
        if capacity is None:
            return []
        return capacity(model) if model is not None and len(self.models) > 1 else capacity()

    def admission_budget(self, model: str | None = None) -> Budget:
        """The limits' budget of one model's requests (its admission pool; None or "": the default
        model's); sequences and prefill tokens default to this gateway's share of that model's live
        workers' (`--gateways`: several gateways in front of them admit their capacity once)."""
        lim, live = self.limits, self.live_capacity(model or None)
        share = lambda capacity: -(-capacity // lim.gateways)  # noqa: E731 - rounded up: 0 stays unknown
        return Budget(lim.max_running_sequences or share(batch_capacity(live)), lim.max_running_tokens,
                      lim.max_prefill_tokens or share(prefill_capacity(live)))


@dataclass
class PreparedRequest:
    """A checked request: what to generate and how to write it out."""

    request_id: str
    prompts: list[list[int]]  # token ids of each prompt (several: /v1/completions with a list)
    sampling: SamplingParams
    formatter: ChatFormatter | CompletionFormatter
    stream: bool
    include_usage: bool
    echo: list[EchoPrompt] | None = None
    limit_param: str = "max_tokens"  # the request's name for the completion budget (in errors)
    cache_salt: str | None = None  # with the tenant, the prefix-cache namespace (cache_namespace.py)
    adapter: str = ""  # the LoRA adapter `model` named ("" = the base model): part of the cache scope
    model: ServedModel | None = None  # the base model `model` named (its tokenizer made `prompts`)


class OpenAIEndpoints:
    def __init__(self, ctx: GatewayContext):
        self.ctx = ctx

    # --- routes -------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ENDPOINT_CHAT, self._prepare_chat)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, ENDPOINT_COMPLETIONS, self._prepare_completion)

    async def responses(self, request: Request) -> Response:
        return await self._serve(request, ENDPOINT_RESPONSES, self._prepare_responses)

    async def list_models(self) -> JSONResponse:
        cards = [self._model_card(model) for model in self.ctx.models.values()]
        cards += [self._model_card(self.ctx.models[parent], name)
                  for name, parent in sorted(self.ctx.adapter_parents().items())]
        return JSONResponse({"object": "list", "data": cards})

    async def get_model(self, model: str) -> Response:
        try:
            base, adapter = self.ctx.resolve_model(model)
        except APIError as exc:
            return exc.response()
        return JSONResponse(self._model_card(base, adapter))

    async def health(self) -> Response:
        if not self.ctx.backend.ready():
            return APIError(503, "the backend is not ready to serve yet", "server_error", None,
                            "not_ready").response()
        # Ready once a chat-template helper of every model is up too (started with the app): on a
        # busy node its interpreter and tokenizer imports take seconds the first chat request
        # must not wait for.
        for model in self.ctx.models.values():
            pool = model.renderer.pool
            if not pool.ready:
                pool.ensure_starting()
                why = (f"could not start ({pool.start_error}); trying again" if pool.start_error
                       else "is still starting")
                of = f" of {model.name}" if len(self.ctx.models) > 1 else ""
                return APIError(503, f"the chat template helper process{of} {why}", "server_error", None,
                                "not_ready").response()
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        return Response(self.ctx.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self, model: ServedModel, adapter: str = "") -> dict:
        """A base model's card, or a LoRA adapter's with its base model as `parent` (as vLLM)."""
        base = model.name
        return {"id": adapter or base, "object": "model", "created": self.ctx.created, "owned_by": "duet",
                "root": adapter or base, "parent": base if adapter else None, "max_model_len": model.max_context_len}

    # --- request preparation -----------------------------------------------------------

    async def _prepare_chat(self, body: bytes) -> PreparedRequest:
        req = parse_chat_request(body)
        model, adapter = self.ctx.resolve_model(req.model)
        choice = req.effective_tool_choice
        tools = req.tools if choice != "none" else None
        template_kwargs = checked_template_kwargs(req.chat_template_kwargs, self.ctx.template.kwargs_allowed)
        messages, template_tools = model.tool_template.render(req.template_messages(), tools)
        prompt_ids = await model.renderer.chat_prompt_ids(messages, template_kwargs, template_tools)
        sampling = chat_sampling(req, len(prompt_ids), model.max_context_len)
        grammar = response_format_grammar(req.response_format)
        if tools:
            grammar = tool_choice_grammar(tools, choice, req.parallel_tool_calls) or grammar
        sampling.grammar = await checked(model.grammar_guard, grammar)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        formatter = ChatFormatter(request_id, adapter or model.name, int(time.time()),
                                  model.token_strings,
                                  logprobs=sampling.logprobs is not None, top_logprobs=sampling.logprobs or 0,
                                  include_usage=req.include_usage, n=sampling.n,
                                  tools=self._tool_mode(model, tools, choice))
        limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        return PreparedRequest(request_id, [prompt_ids], sampling, formatter, bool(req.stream), req.include_usage,
                               limit_param=limit_param, cache_salt=req.cache_salt, adapter=adapter, model=model)

    def _tool_mode(self, model: ServedModel, tools, choice, flat: bool = False) -> ToolMode | None:
        """How answers are read for tool calls (None: never)."""
        if not tools:
            return None
        name = named_choice(choice, flat)
        if name is not None:
            return ToolMode("named", name)
        if choice == "required":
            return ToolMode("required")
        if self.ctx.tool_call_parser == "none":
            return None
        return ToolMode(model.tool_template.parser)

    async def _prepare_responses(self, body: bytes) -> PreparedRequest:
        req = parse_responses_request(body)
        model, adapter = self.ctx.resolve_model(req.model)
        choice = req.effective_tool_choice
        flat = req.tools if choice != "none" else None
        tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                 for t in flat or []] or None
        messages, template_tools = model.tool_template.render(req.chat_messages(), tools)
        prompt_ids = await model.renderer.chat_prompt_ids(messages, None, template_tools)
        sampling = responses_sampling(req, len(prompt_ids), model.max_context_len)
        grammar = response_format_grammar(req.format, "text.format", "text.format.schema")
        if flat:
            grammar = tool_choice_grammar(flat, choice, req.parallel_tool_calls, flat=True) or grammar
        sampling.grammar = await checked(model.grammar_guard, grammar)
        request_id = _response_id()
        echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "tools": [_function_tool(t) for t in req.tools or []],
                "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
                "metadata": req.metadata or {}, "text": {"format": (req.text.format if req.text and req.text.format
                                                                    else {"type": "text"})}}
        formatter = ResponsesFormatter(request_id, adapter or model.name, int(time.time()), echo,
                                       tools=self._tool_mode(model, flat, choice, flat=True))
        return PreparedRequest(request_id, [prompt_ids], sampling, formatter, bool(req.stream), False,
                               limit_param="max_output_tokens", cache_salt=req.cache_salt, adapter=adapter,
                               model=model)

    async def _prepare_completion(self, body: bytes) -> PreparedRequest:
        req = parse_completion_request(body)
        model, adapter = self.ctx.resolve_model(req.model)
        prompts = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                prompts.append(await asyncio.to_thread(model.prompts.text_prompt_ids, prompt))
            else:
                prompts.append(model.prompts.check_token_ids(prompt))
        # every prompt must fit (each is checked); one budget for all: the asked one, or the
        # default capped by the longest prompt's room
        options = [completion_sampling(req, len(ids), model.max_context_len) for ids in prompts]
        sampling = min(options, key=lambda o: o.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        echo = None
        if req.echo:
            texts = [p if isinstance(p, str) else model.prompts.tokenizer.decode(p) for p in req.prompts()]
            echo = [EchoPrompt(text, ids) for text, ids in zip(texts, prompts)]
        formatter = CompletionFormatter(request_id, adapter or model.name, int(time.time()),
                                        model.token_strings, logprobs=req.logprobs,
                                        include_usage=req.include_usage, n=sampling.n, echo=echo,
                                        echo_only=req.echo_only)
        return PreparedRequest(request_id, prompts, sampling, formatter, bool(req.stream), req.include_usage, echo,
                               cache_salt=req.cache_salt, adapter=adapter, model=model)

    # --- serving --------------------------------------------------------------------------

    async def _serve(self, request: Request, endpoint: str,
                     prepare: Callable[[bytes], Awaitable[PreparedRequest]]) -> Response:
        arrived_at = time.monotonic()
        metrics = self.ctx.metrics
        metrics.inflight.labels(endpoint).inc()
        span = self.ctx.tracer.start_span(
            f"POST /v1/{endpoint.replace('_', '/')}", context=extract_http_context(request.headers),
            kind=trace.SpanKind.SERVER)
        # The admission ticket is held until the outcome is recorded: the end of the answer,
        # of the stream (on_close), or of a cancelled task.
        tenant = request.scope.get("state", {}).get("tenant")  # the API key's (http_edge/auth.py)
        ticket = self.ctx.admission.ticket(tenant)
        outcome = _Outcome(lambda status: (ticket.release(), self._finish(endpoint, status, span, outcome.model)))
        try:
            body = await request.body()  # first: the disconnect watch below reads receive()
            try:
                ticket.hold_place()  # refused at once, before any work, when every place is taken
            except AdmissionRefused as exc:
                raise server_busy(str(exc), exc.retry_after_s) from None
            try:
                prepared = await prepare(body)
                outcome.model = (prepared.model or self.ctx.default_model).name
                metrics.request_resolved(outcome.model)
                works = self._work(prepared)  # what can never fit: 400 now, before anything is sent
            except InvalidRequest as exc:
                raise from_invalid_request(exc) from None
            try:
                first = await run_until_disconnect(request.receive, ticket.acquire(works[0]))
            except AdmissionRefused as exc:
                raise server_busy(str(exc), exc.retry_after_s) from None
            model = prepared.model or self.ctx.default_model
            span.set_attribute("duet.request_id", prepared.request_id)
            span.set_attribute("duet.model", model.name)
            span.set_attribute("duet.lora_adapter", prepared.adapter or "")
            span.set_attribute("duet.prompt_tokens", sum(len(p) for p in prepared.prompts))
            trace_context = inject_http_headers({}, context=trace.set_span_in_context(span))
            # its namespace, tenant and LoRA adapter: base and adapter never share a page
            cache_scope = dataclasses.replace(self.ctx.cache_namespaces.scope(tenant, prepared.cache_salt),
                                              adapter=prepared.adapter)
            generations = []
            for k, prompt_ids in enumerate(prepared.prompts):
                rid = prepared.request_id if len(prepared.prompts) == 1 else f"{prepared.request_id}-{k}"
                gen_request = GenerationRequest(rid, prompt_ids, prepared.sampling,
                                                model=model.name, group=prepared.request_id,
                                                trace_context=trace_context, cache_scope=cache_scope)
                metrics.prompt_tokens.labels(endpoint, model.name, prepared.adapter or "").inc(len(prompt_ids))
                generations.append(Generation(self.ctx.backend, gen_request, model.prompts.tokenizer, metrics,
                                              endpoint, arrived_at=arrived_at))
                if prepared.echo is not None:
                    prepared.echo[k].stats = generations[-1].stats
            generation = GenerationSet(generations, prepared.sampling.n, admit=_Units(ticket, works, first).enter)
            headers = {"X-Request-Id": prepared.request_id}
            if prepared.stream:
                response = await self._stream(request, generation, prepared, outcome, headers, endpoint, span)
                outcome.handed_off = True  # the stream records its own outcome when it ends
                return response
            body = await run_until_disconnect(request.receive, self._collect(generation, prepared))
            self._count_cached(endpoint, generation)
            outcome.record(200)
            return JSONResponse(body, headers=headers)
        except APIError as exc:
            outcome.record(exc.status)
            return exc.response()
        except BackendError as exc:
            error = from_backend_error(exc)
            outcome.record(error.status)
            return error.response()
        except ClientDisconnected:
            outcome.record(STATUS_CANCELLED)
            return Response(status_code=STATUS_CANCELLED)
        except Exception:
            log.exception("request failed")
            outcome.record(500)
            return internal_error().response()
        finally:
            if not outcome.handed_off:
                outcome.record(STATUS_CANCELLED)  # no-op when recorded; cancelled task otherwise

    def _work(self, prepared: PreparedRequest) -> list[Work]:
        """Each prompt's admission weight; InvalidRequest when one could never fit a live worker
        (every prompt of a list is checked before any is sent)."""
        capacity = self.ctx.live_capacity(prepared.model.name if prepared.model is not None else None)
        n, max_tokens = prepared.sampling.n, prepared.sampling.max_tokens
        works = []
        for prompt_ids in prepared.prompts:
            check_fits_some_worker(capacity, len(prompt_ids), max_tokens, n, prepared.limit_param)
            works.append(Work(n, kv_demand(len(prompt_ids), max_tokens, n).tokens, len(prompt_ids),
                              pool=prepared.model.name if prepared.model is not None else ""))
        return works

    def _finish(self, endpoint: str, status, span, model: str = "") -> None:
        self.ctx.metrics.request_finished(endpoint, status, model)
        self.ctx.metrics.inflight.labels(endpoint).dec()
        span.set_attribute("http.status_code", status)
        span.end()

    def _count_cached(self, endpoint: str, generation: GenerationSet) -> None:
        """An answer's cached prompt tokens, as its usage reports them."""
        self.ctx.metrics.cached_prompt_tokens.labels(endpoint).inc(generation.stats.cached_tokens)

    async def _collect(self, generation: GenerationSet, prepared: PreparedRequest) -> dict:
        deltas: list[OutputDelta] = []
        async for delta in generation.deltas():
            deltas.append(delta)
        return prepared.formatter.response(deltas, generation.stats)

    async def _stream(self, request: Request, generation: GenerationSet, prepared: PreparedRequest,
                      outcome: "_Outcome", headers: dict[str, str], endpoint: str, span) -> Response:
        deltas = generation.deltas()
        # Wait for the first delta before answering 200, so that a refusal (no KV room,
        # no workers) is still a proper HTTP status rather than an in-stream error.
        try:
            first = await run_until_disconnect(request.receive, _next(deltas))
        except BaseException:
            await deltas.aclose()
            raise
        formatter = prepared.formatter
        status: dict[str, Any] = {"value": 200}
        times = StreamTimes()

        async def events():
            try:
                named = formatter.named_events
                for chunk in formatter.opening_chunks():
                    yield times.sent(sse_event(chunk, named))
                delta = first
                while delta is not None:
                    for chunk in formatter.chunks_for(delta):
                        yield times.sent(sse_event(chunk, named))
                    delta = await anext(deltas, None)
                self._count_cached(endpoint, generation)
                for chunk in formatter.closing_chunks(generation.stats):
                    yield times.sent(sse_event(chunk, named))
                if formatter.done_marker:
                    yield times.sent(DONE_EVENT)
            except BackendError as exc:
                error = from_backend_error(exc)
                status["value"] = error.status
                yield times.sent(error.sse_event())
            except Exception:
                log.exception("stream failed")
                status["value"] = 500
                yield times.sent(internal_error().sse_event())

        async def on_close(disconnected: bool) -> None:
            await deltas.aclose()  # aborts the backend's work if it is still running
            stats = generation.stats
            times.record(self.ctx.tracer, span, {"duet.request_id": prepared.request_id,
                                                 "duet.completion_tokens": stats.completion_tokens,
                                                 "duet.cached_tokens": stats.cached_tokens,
                                                 "duet.stream.disconnected": disconnected})
            outcome.record(STATUS_CANCELLED if disconnected else status["value"])

        return EventStreamResponse(events(), on_close, headers)


def _function_tool(tool: dict) -> dict:
    """A Responses function tool as a response repeats it (strict defaults to true there)."""
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict") is not False}


def _response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


async def _next(iterator):
    return await iterator.__anext__()


@dataclass
class _Units:
    """The admission of one request's prompts: the first was granted before the answer
    started; each other one waits for its turn when its generation starts."""

    ticket: Ticket
    works: list[Work]
    first: Grant

    async def enter(self, k: int) -> Grant:
        return self.first if k == 0 else await self.ticket.acquire_more(self.works[k])


class _Outcome:
    """Records a request's outcome exactly once (metrics, span)."""

    def __init__(self, finish: Callable[[Any], None]):
        self._finish = finish
        self.recorded = False
        self.handed_off = False
        self.model = ""  # the request's base model once it resolved (its per-model counts)

    def record(self, status) -> None:
        if not self.recorded:
            self.recorded = True
            self._finish(status)
