"""Send one streaming request and time every chunk. Raw httpx and our own SSE parsing, not the
openai client: each `data:` line is stamped as it is read, before any JSON work, so per-chunk
timing is the network's and not the parser's."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from loadtest.config import EndpointConfig
from loadtest.records import RequestRecord


@dataclass
class PreparedRequest:
    """A request body ready to send, with its tokenizer-counted prompt length."""

    body: dict
    prompt_len: int
    max_tokens: int


def build_body(endpoint: EndpointConfig, model: str, messages: list[dict] | None, prompt: str | list[int] | None,
               max_tokens: int) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": endpoint.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    body.update({"messages": messages} if endpoint.api == "chat" else {"prompt": prompt})
    if endpoint.ignore_eos != "off":
        body["ignore_eos"] = True  # vLLM/SGLang extension; others ignore or reject it
    body.update(endpoint.extra_body)
    return body


def _chunk_text(choice: dict, api: str) -> str:
    if api == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _chunk_tokens(choice: dict) -> int:
    """Tokens a chunk carries by its logprobs (asked for: each token has an entry, also one
    whose text is empty, e.g. a random-weight model's id past its tokenizer's pieces)."""
    logprobs = choice.get("logprobs") or {}
    return len(logprobs.get("tokens") or logprobs.get("content") or [])


async def send_streaming(
    client: httpx.AsyncClient,
    url: str,
    endpoint: EndpointConfig,
    prepared: PreparedRequest,
    record: RequestRecord,
    clock: Callable[[], float],
) -> RequestRecord:
    """Fill `record` in place with what the server did; never raises for server faults."""
    pieces: list[str] = []
    record.sent_at = clock()
    try:
        async with client.stream("POST", url, json=prepared.body) as resp:
            record.http_status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                return _fail(record, f"http_{resp.status_code}", body[:500], clock)
            async for line in resp.aiter_lines():
                now = clock()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                obj = json.loads(payload)
                if obj.get("error"):
                    return _fail(record, "stream_error", json.dumps(obj["error"])[:500], clock)
                record.response_id = record.response_id or obj.get("id")
                for choice in obj.get("choices") or []:
                    text = _chunk_text(choice, endpoint.api)
                    if text or _chunk_tokens(choice):
                        if record.first_token_at is None:
                            record.first_token_at = now
                        record.chunk_times.append(now)
                        pieces.append(text)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                usage = obj.get("usage")
                if usage:
                    record.usage_prompt_tokens = usage.get("prompt_tokens")
                    record.usage_completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        record.usage_cached_tokens = details["cached_tokens"]
    except httpx.TimeoutException as e:
        return _fail(record, "timeout", repr(e), clock)
    except httpx.ConnectError as e:
        return _fail(record, "connect", repr(e), clock)
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        return _fail(record, "disconnected", repr(e), clock)
    except json.JSONDecodeError as e:
        return _fail(record, "bad_json", repr(e), clock)
    except httpx.HTTPError as e:
        return _fail(record, type(e).__name__, repr(e), clock)
    record.done_at = clock()
    record.output_text = "".join(pieces)
    record.output_chars = len(record.output_text)
    if not pieces and record.finish_reason is None:
        return _fail(record, "no_output", "stream ended without text or finish_reason", clock)
    if record.first_token_at is None:
        record.first_token_at = record.done_at  # finished at once (e.g. EOS first): answer time
    record.ok = True
    return record


def _fail(record: RequestRecord, kind: str, detail: str, clock: Callable[[], float]) -> RequestRecord:
    record.ok, record.error_kind, record.error_detail, record.done_at = False, kind, detail, clock()
    return record


def make_client(endpoint: EndpointConfig, max_connections: int | None) -> httpx.AsyncClient:
    return httpx.AsyncClient(headers=endpoint.http_headers, timeout=httpx.Timeout(endpoint.timeout_s, connect=30.0),
                             limits=httpx.Limits(max_connections=max_connections,
                                                 max_keepalive_connections=max_connections))


def monotonic_from(start: float) -> Callable[[], float]:
    return lambda: time.perf_counter() - start
