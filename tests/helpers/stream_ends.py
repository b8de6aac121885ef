"""A streamed completion run in a thread, and how its body ended: for tests that kill or stop parts
of a stack while it streams (tests/e2e/test_e2e_duet_up_supervised.py, test_e2e_restart_rebuilds.py)."""
from __future__ import annotations

import json
import threading

import httpx


def stream_end(stack, started: threading.Event, max_tokens: int, result: dict) -> None:
    """Stream a completion; result["end"]: "done" ([DONE]), "error" (an error event) or
    "cut" (the body ended with neither)."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Tell me a long story about the sea.",
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    last = None
    try:
        with httpx.stream("POST", stack.base_url + "/completions", json=body, timeout=120) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                    last = line[len("data: "):]
    except httpx.HTTPError as exc:
        result["exception"] = repr(exc)
    finally:
        started.set()
    if last == "[DONE]":
        result["end"] = "done"
    elif last is not None and "error" in json.loads(last):
        result["end"] = "error"
    else:
        result["end"] = "cut"
    result["last"] = last


def start_stream(stack, max_tokens: int) -> tuple[threading.Thread, dict]:
    started, result = threading.Event(), {}
    thread = threading.Thread(target=stream_end, args=(stack, started, max_tokens, result), daemon=True)
    thread.start()
    assert started.wait(120), "the stream never started"
    return thread, result
