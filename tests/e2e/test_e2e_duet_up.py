"""The split serving path end to end against `duet up` (default model, 1 prefill + 1 decode).

Everything real: duet up's own redis-server, the router and workers over gRPC, the KV
moved by NIXL/UCX between the two worker processes, the gateway on uvicorn, the official
openai client. Expected texts come from the offline engine (shared.engine.LLM) and HF
transformers on the same token ids; every body, stream chunk and error is checked
against OpenAI's schemas.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time

import httpx
import openai
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.openai_schema import validate
from tests.helpers.otlp_receiver import GrpcReceiver
from tests.helpers.stack import (
    DuetUp,
    http_status,
    managed,
    model_dir,
    new_log_dir,
    offline_llm,
    offline_outputs,
    page_bytes,
    transformers_greedy,
    wait_until,
)

MAX_TOKENS = 12
PAGE_SIZE = 16  # the workers' default
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
COMPLETIONS = ["The three primary colors are", "def fibonacci(n):\n   "]
SEEDED_CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir()))


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """(kind, request payload, prompt token ids) for every greedy case."""
    cases = [("chat", m, chat_ids(tokenizer, m)) for m in CHATS]
    cases += [("completion", p, tokenizer.encode(p)) for p in COMPLETIONS]
    return cases


@pytest.fixture(scope="module")
def traces():
    """Every process of the split stack exports its spans here, set by the standard OTEL_* variables."""
    with GrpcReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def split_stack(request, traces):
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_ENDPOINT": traces.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with managed(request, DuetUp(new_log_dir("up-split"), env=env).start()) as stack:
        yield stack


@pytest.fixture(scope="module")
def llm():
    return offline_llm(model_dir())


@pytest.fixture(scope="module")
def references(prompts, split_stack, llm):
    """Offline engine and transformers answers, computed while the stack boots."""
    ids = [p for _, _, p in prompts]
    offline = offline_outputs(llm, ids, MAX_TOKENS)
    hf = transformers_greedy(model_dir(), ids, MAX_TOKENS)
    split_stack.wait_ready()
    return offline, hf


@pytest.fixture(scope="module")
def stack(split_stack, references):
    return split_stack


def served_model(stack) -> str:
    return stack.client().models.list().data[0].id


def sse_json(lines) -> list:
    """The data payloads of an SSE stream: parsed JSON, or the final "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def run_case(client, model, kind, payload, *, stream: bool):
    """One greedy request through the openai client; returns (text, usage dict, finish)."""
    api = client.chat.completions if kind == "chat" else client.completions
    args = dict(model=model, max_tokens=MAX_TOKENS, temperature=0)
    args.update(messages=payload) if kind == "chat" else args.update(prompt=payload)
    if not stream:
        raw = api.with_raw_response.create(**args)
        body = raw.http_response.json()
        validate(body, "CreateChatCompletionResponse" if kind == "chat" else "CreateCompletionResponse")
        parsed = raw.parse()
        choice = parsed.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        return text, body["usage"], choice.finish_reason
    schema = "CreateChatCompletionStreamResponse" if kind == "chat" else "CreateCompletionStreamResponse"
    with api.with_streaming_response.create(stream=True, stream_options={"include_usage": True}, **args) as r:
        events = sse_json(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        validate(chunk, schema)
    pieces, finishes = [], []
    for c in chunks:
        for choice in c["choices"]:
            piece = choice["delta"].get("content") if kind == "chat" else choice["text"]
            pieces.append(piece or "")
            finishes.append(choice["finish_reason"])
    assert all(f is None for f in finishes[:-1]) and finishes[-1] is not None
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] is not None
    return "".join(pieces), chunks[-1]["usage"], finishes[-1]


def test_stack_serves_health_and_models(stack):
    assert http_status(stack.health_url) == 200
    models = httpx.get(stack.base_url + "/models", timeout=10).json()
    validate(models, "ListModelsResponse")
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
    entries = stack.workers()
    assert {f["role"] for f in entries.values()} == {"prefill", "decode"}
    for wid, f in entries.items():
        assert f["model"] == "SmolLM2-135M-Instruct" and f["instance_nonce"]
        assert f["address"].startswith("127.0.0.1:") and f["metrics"].startswith("127.0.0.1:")
        assert int(f["load_total_pages"]) > 0 and float(f["load_kv_usage"]) == 0.0
        assert json.loads(f["nixl_agents"]), wid
        assert 0 < stack.redis().pttl(f"duet:worker:{wid}") <= 6000  # written with its TTL


def test_offline_engine_equals_transformers(references):
    offline, hf = references
    for out, hf_ids in zip(offline, hf):
        assert out.token_ids == hf_ids


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_answers_equal_the_offline_engine(stack, references, prompts, stream):
    offline, _ = references
    client = stack.client()
    model = served_model(stack)
    for (kind, payload, ids), ref in zip(prompts, offline):
        text, usage, finish = run_case(client, model, kind, payload, stream=stream)
        assert text == ref.text, (kind, payload)
        assert usage["prompt_tokens"] == len(ids)
        assert usage["completion_tokens"] == len(ref.token_ids)
        assert usage["total_tokens"] == len(ids) + len(ref.token_ids)
        assert finish == ref.finish_reason
    if not stream:  # the stream cases run second; one plain client stream as a client would
        chunks = list(client.chat.completions.create(model=model, messages=CHATS[0], max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline[0].text
    stack.wait_idle()


def complete_once(client, model: str, prompt: str, stream: bool):
    """(answer id, text, usage) of one greedy completion of 8 tokens, streamed or not."""
    args = dict(model=model, prompt=prompt, max_tokens=8, temperature=0)
    if not stream:
        result = client.completions.create(**args)
        return result.id, result.choices[0].text, result.usage
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    return chunks[0].id, "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage


def request_trace(traces, answer_id: str, wanted: set[tuple[str, str]], timeout: float = 20.0) -> dict:
    """The spans of one request's trace, found by its gateway root's duet.request_id, once every
    (service name, span name) in `wanted` arrived: (service, name) -> span."""
    [root] = traces.wait_for(lambda s: not s.parent_span_id and s.attributes.get("duet.request_id") == answer_id,
                             timeout)
    deadline = time.monotonic() + timeout
    while True:
        found = {(s.resource["service.name"], s.name): s for s in traces.wait_for(
            lambda s: s.trace_id == root.trace_id, timeout)}
        if wanted <= set(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def assert_child(child, parent) -> None:
    """child is parent's, within its time (the phase spans' times are the engine's monotonic
    stamps put on the wall clock: a few ms of slack)."""
    slack = 5_000_000
    assert child.parent_span_id == parent.span_id, (child.name, parent.name)
    assert parent.start_ns - slack <= child.start_ns <= child.end_ns <= parent.end_ns + slack, (child, parent)


def test_kv_bytes_and_computed_tokens_match_the_prompt(stack, tokenizer, traces):
    """Prefill computes the prompt and sends its pages; decode receives exactly those bytes
    and computes only the new tokens. Asked again: the decode worker holds the prompt's full
    pages now (it kept what it decoded, and its KV events say so), so the router has it
    prefill the rest itself: nothing moves, decode computes only the last partial page.
    Each worker times the tokens it served (one TTFT per request, labelled by the phase it
    served), the gateway counts the cached tokens its answers report, and the traces show
    where the time went: queue, compute and the KV send on prefill, the KV wait, queue and
    compute on decode, the stream on the gateway (the second answer streams)."""
    prefill, decode = stack.worker_ids("prefill")[0], stack.worker_ids("decode")[0]
    entry = stack.workers()[prefill]
    per_page = page_bytes(model_dir(), PAGE_SIZE)
    assert json.loads(entry["kv_pools"])[0]["page_bytes"] == per_page
    assert int(entry["page_size"]) == PAGE_SIZE
    prompt = ("Zanzibar's spice markets, described by a careful geographer in exactly forty-one words, "
              "with the names of three spices and the months of the harvest:")
    ids = tokenizer.encode(prompt)
    assert len(ids) > 2 * PAGE_SIZE
    pages = math.ceil(len(ids) / PAGE_SIZE)
    full = (len(ids) - 1) // PAGE_SIZE * PAGE_SIZE  # at least one token is always computed
    texts = []
    for attempt in range(2):
        before = {w: stack.metrics(w) for w in (prefill, decode)}
        gateway_before = stack.gateway_metrics()
        pages_before = stack.redis().smembers(f"duet:worker:{decode}:pages")
        answer_id, text, usage = complete_once(stack.client(), served_model(stack), prompt, stream=attempt == 1)
        texts.append(text)
        assert usage.prompt_tokens == len(ids)
        cached = usage.prompt_tokens_details.cached_tokens or 0
        assert cached == (0 if attempt == 0 else full), cached
        completion = usage.completion_tokens
        assert completion > 2

        def delta(worker, name, **labels):
            return stack.metrics(worker).value(name, **labels) - before[worker].value(name, **labels)

        # counters are refreshed by the workers' load loop: wait for the decode side
        wait_until(lambda: delta(decode, "duet_engine_tokens_computed_total", phase="decode") >= completion - 1,
                   10, "decode's computed-token counter")
        sent = delta(prefill, "duet_kv_transfer_bytes_total", direction="sent")
        received = delta(decode, "duet_kv_transfer_bytes_total", direction="received")
        assert delta(decode, "duet_kv_recomputes_total") == 0
        assert stack.gateway_metrics().value("duet_cached_prompt_tokens_total", endpoint="completions") - \
            gateway_before.value("duet_cached_prompt_tokens_total", endpoint="completions") == cached
        generated = delta(decode, "duet_requests_total", endpoint="Generate", outcome="ok")
        assert generated == 1
        if attempt == 0:  # split: prefill computes and writes every page
            assert sent == received == pages * per_page, (sent, received, pages, per_page)
            assert delta(prefill, "duet_kv_transfer_seconds_count") == 1
            # the handoff tail (last chunk -> last page landed) is part of the whole transfer
            assert delta(prefill, "duet_kv_handoff_tail_seconds_count") == 1
            assert 0 < delta(prefill, "duet_kv_handoff_tail_seconds_sum") <= \
                delta(prefill, "duet_kv_transfer_seconds_sum")
            assert delta(decode, "duet_kv_transfer_seconds_count") == 1
            assert delta(prefill, "duet_engine_tokens_computed_total", phase="prefill") == len(ids)
            assert delta(prefill, "duet_engine_tokens_computed_total", phase="decode") == 0
            assert delta(decode, "duet_engine_tokens_computed_total", phase="prefill") == 0
            # the first token came from prefill; decode ran one step per later token
            assert delta(decode, "duet_engine_tokens_computed_total", phase="decode") == completion - 1
            # each worker's own view: prefill's first token (its answer, the handoff included,
            # comes later); decode sends the other tokens, its first after the KV came
            prefilled = delta(prefill, "duet_requests_total", endpoint="Prefill", outcome="ok")
            assert prefilled == 1
            assert delta(prefill, "duet_time_to_first_token_seconds_count", phase="prefill") == prefilled
            assert delta(prefill, "duet_e2e_request_latency_seconds_count", phase="prefill") == prefilled
            assert 0 < delta(prefill, "duet_time_to_first_token_seconds_sum", phase="prefill") < \
                delta(prefill, "duet_e2e_request_latency_seconds_sum", phase="prefill")
            assert delta(decode, "duet_time_to_first_token_seconds_count", phase="decode") == generated
            assert delta(decode, "duet_inter_token_latency_seconds_count", phase="decode") == completion - 2
            assert delta(decode, "duet_e2e_request_latency_seconds_count", phase="decode") == generated
            # before asking again, the router must see that decode holds the prompt's pages
            # (the hashes are seeded with the gateway's keyed cache namespace, which the test
            # cannot make: count them instead, at least the prompt's full pages)
            wait_until(lambda: len(stack.redis().smembers(f"duet:worker:{decode}:pages") - pages_before)
                       >= full // PAGE_SIZE, 10, "decode's KV events in the registry")
            spans = request_trace(traces, answer_id, {("duet-prefill", n) for n in ("queue", "compute", "kv_send")}
                                  | {("duet-decode", n) for n in ("kv_transfer_wait", "queue", "compute")})
            on_prefill = {n: spans[("duet-prefill", n)] for n in ("prefill", "queue", "compute", "kv_send")}
            for name in ("queue", "compute", "kv_send"):
                assert_child(on_prefill[name], on_prefill["prefill"])
            assert on_prefill["queue"].end_ns == on_prefill["compute"].start_ns
            assert on_prefill["compute"].end_ns <= on_prefill["kv_send"].end_ns  # pages land after the token
            compute = on_prefill["compute"].attributes
            assert (compute["duet.prompt_tokens"], compute["duet.cached_tokens"]) == (len(ids), 0)
            assert compute["duet.chunks"] >= 1
            assert on_prefill["kv_send"].attributes["duet.kv_bytes"] == sent
            assert on_prefill["kv_send"].attributes["duet.kv_pages"] == pages
            on_decode = {n: spans[("duet-decode", n)] for n in ("decode", "kv_transfer_wait", "queue", "compute")}
            for name in ("kv_transfer_wait", "queue", "compute"):
                assert_child(on_decode[name], on_decode["decode"])
            assert on_decode["kv_transfer_wait"].end_ns <= on_decode["queue"].start_ns + 5_000_000
            assert on_decode["queue"].end_ns == on_decode["compute"].start_ns
            compute = on_decode["compute"].attributes
            assert compute["duet.output_tokens"] == compute["duet.steps"] == completion - 1
            assert compute["duet.recomputed"] is False
            assert ("duet-gateway", "stream") not in spans  # a JSON answer
        else:  # local prefill on decode: no prefill worker, no transfer
            assert sent == received == 0, (sent, received)
            assert delta(prefill, "duet_engine_tokens_computed_total", phase="prefill") == 0
            assert delta(decode, "duet_engine_tokens_computed_total", phase="prefill") == len(ids) - full
            assert delta(decode, "duet_engine_tokens_computed_total", phase="decode") == completion - 1
            assert delta(decode, "duet_kv_cache_hit_tokens_total", tier="device") == full
            assert delta(prefill, "duet_time_to_first_token_seconds_count") == 0
            # the whole request on decode: every token timed there
            assert delta(decode, "duet_time_to_first_token_seconds_count", phase="both") == generated
            assert delta(decode, "duet_inter_token_latency_seconds_count", phase="both") == completion - 1
            assert delta(decode, "duet_e2e_request_latency_seconds_count", phase="both") == generated
            spans = request_trace(traces, answer_id, {("duet-decode", "queue"), ("duet-decode", "compute"),
                                                      ("duet-gateway", "stream")})
            assert not any(service == "duet-prefill" for service, _ in spans)
            on_decode = {n: spans[("duet-decode", n)] for n in ("decode", "queue", "compute")}
            for name in ("queue", "compute"):
                assert_child(on_decode[name], on_decode["decode"])
            compute = on_decode["compute"].attributes
            assert (compute["duet.prompt_tokens"], compute["duet.cached_tokens"]) == (len(ids), full)
            assert compute["duet.output_tokens"] == compute["duet.steps"] == completion
            assert compute["duet.chunks"] >= 1
            root = next(s for s in spans.values() if not s.parent_span_id)
            stream = spans[("duet-gateway", "stream")]
            assert_child(stream, root)
            assert stream.attributes["duet.completion_tokens"] == completion
            assert stream.attributes["duet.cached_tokens"] == full
    assert texts[0] == texts[1]
    gateway = stack.gateway_metrics()
    for name in ("duet_time_to_first_token_seconds_count", "duet_inter_token_latency_seconds_count",
                 "duet_requests_total"):
        assert gateway.value(name) > 0, name
    stack.wait_idle()


def test_early_endings_free_every_page(stack, references, prompts):
    """max_tokens=1 ends at prefill's token (the gateway cancels the decode reservation);
    a stop string ends the stream early (the gateway cancels decode's stream). Either way
    decode computes nothing more and every page is freed."""
    offline, _ = references
    _, completion_prompt, _ = prompts[2]
    decode = stack.worker_ids("decode")[0]
    client, model = stack.client(), served_model(stack)

    def decode_steps():
        return stack.metrics(decode).value("duet_engine_tokens_computed_total", phase="decode")
    before = decode_steps()
    r = client.completions.create(model=model, prompt=completion_prompt, max_tokens=1, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1
    assert offline[2].text.startswith(r.choices[0].text)
    stack.wait_idle(timeout=10)
    assert decode_steps() == before  # decode never ran: the reservation was cancelled

    stop = offline[2].text.split()[2]  # a word a few tokens into the greedy answer
    stream = client.completions.create(model=model, prompt=completion_prompt, max_tokens=300, temperature=0,
                                       stop=[stop], stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert offline[2].text.startswith(text) and stop not in text
    assert chunks[-1].choices[0].finish_reason == "stop"
    stack.wait_idle(timeout=15)
    assert decode_steps() - before < 100  # stopped long before max_tokens


@pytest.fixture(scope="module")
def colocated_stack(request):
    # --insecure: this module's other stack runs the default (secure) one
    up = DuetUp(new_log_dir("up-both"), "--both", "1", "--prefill", "0", "--decode", "0", "--insecure")
    with managed(request, up.start()) as stack:
        yield stack.wait_ready()


def test_seeded_sample_is_the_same_split_and_colocated(stack, colocated_stack, tokenizer, llm):
    def sample(s, seed):
        r = s.client().chat.completions.create(model=served_model(s), messages=SEEDED_CHAT, max_tokens=16,
                                               temperature=0.8, seed=seed)
        return r.choices[0].message.content
    split = [sample(stack, seed) for seed in (1234, 99)]
    assert split[0] != split[1]  # the seed matters: this is sampling, not greedy
    assert sample(colocated_stack, 1234) == split[0]
    offline = offline_outputs(llm, [chat_ids(tokenizer, SEEDED_CHAT)], 16, temperature=0.8, seed=1234)
    assert offline[0].text == split[0]
    assert {f["role"] for f in colocated_stack.workers().values()} == {"both"}
    stack.wait_idle()
    colocated_stack.wait_idle()


def test_insecure_says_so_and_serves_plaintext_grpc(stack, colocated_stack):
    out = colocated_stack.proc.log_text()
    assert "duet up: INSECURE (--insecure): gRPC is plaintext" in out  # at start, and in the banner
    assert "gRPC    plaintext, open to every local process (--insecure)" in out
    assert colocated_stack.redis_password is None and colocated_stack.certs_dir is None
    assert "gRPC    mutual TLS" in stack.proc.log_text() and "INSECURE" not in stack.proc.log_text()
    with colocated_stack.worker_channel("both-0", "decode") as channel:  # a plaintext channel: served
        chunks = list(duet_pb2_grpc.DecodeStub(channel).Generate(duet_pb2.GenerateRequest(
            request_id="plaintext", prompt_token_ids=[1, 2, 3],
            sampling=duet_pb2.SamplingParams(temperature=0, top_p=1, max_tokens=2, ignore_eos=True)), timeout=60))
    assert chunks[-1].usage.completion_tokens == 2
    colocated_stack.wait_idle()


def session_processes(leader_pid: int) -> dict[int, str]:
    """pid -> command line of every live process in the session duet up leads."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != leader_pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                if f.read().split(")")[1].split()[0] == "Z":
                    continue  # exited, not yet reaped
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            continue
        out[int(entry)] = cmd
    return out


def test_duet_up_reports_a_dead_worker_and_stops_everything(colocated_stack):
    """Runs after the seeded test: SIGKILL the colocated worker, duet up reports it and
    keeps running; SIGTERM duet up, it stops every child and exits by itself."""
    up = colocated_stack.proc
    procs = session_processes(up.pid)
    assert any("redis-server" in c for c in procs.values())
    worker = [p for p, c in procs.items() if "--worker-id both-0" in c]
    assert len(worker) == 1 and len(procs) >= 5, procs  # duet up, redis, router, worker, gateway
    os.kill(worker[0], signal.SIGKILL)
    wait_until(lambda: "both-0 exited with code -9" in up.log_text(), 15, "duet up to report the dead worker")
    assert up.alive
    up.signal(signal.SIGTERM)
    up.popen.wait(60)
    assert up.popen.returncode == 0
    assert "duet up: stopped (" in up.log_text()  # the last word says it is over
    wait_until(lambda: session_processes(up.pid) == {}, 10, "every child of duet up to exit")


BAD_REQUESTS = [
    ("/chat/completions", {"messages": CHATS[0], "temperature": -1}, 400),
    ("/chat/completions", {"messages": CHATS[0], "max_tokens": 0}, 400),
    ("/chat/completions", {"messages": []}, 400),
    ("/chat/completions", {"messages": CHATS[0], "n": 0}, 400),
    ("/chat/completions", {"messages": CHATS[0], "max_tokens": 10 ** 6}, 400),
    ("/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("/completions", {"prompt": "hello " * 9000}, 400),
    ("/completions", {"prompt": [10 ** 9]}, 400),
    ("/chat/completions", {"model": "no-such-model", "messages": CHATS[0]}, 404),
    ("/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_bad_requests_get_openai_errors_and_leave_no_kv(stack, stream):
    model = served_model(stack)
    with httpx.Client(base_url=stack.base_url, timeout=60) as http:
        for path, body, status in BAD_REQUESTS:
            body = {"model": model, **body, "stream": stream}
            r = http.post(path, json=body)
            assert r.status_code == status, (path, body, r.text[:300])
            validate(r.json(), "ErrorResponse")
            assert r.json()["error"]["message"]
            stack.wait_idle(timeout=10)
        r = http.post("/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        validate(r.json(), "ErrorResponse")
    client = stack.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHATS[0], stream=stream)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", temperature=-1, stream=stream)
    stack.wait_idle()


def test_duet_up_without_redis_server_says_how_to_install_one(tmp_path):
    import subprocess

    from tests.helpers.stack import child_env, duet_argv, free_port
    env = child_env({"PATH": str(tmp_path)})  # no redis-server on PATH
    r = subprocess.run(duet_argv("up", "--port", str(free_port()), "--log-dir", str(tmp_path)),
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "redis-server" in r.stderr and "apt-get install redis-server" in r.stderr
    assert "--redis-url" in r.stderr


def test_prefill_connects_to_each_decode_worker_before_any_request(stack):
    """The prefill worker probes every decode worker as it joins (services/prefill/
    peer_warmup.py): one padding-page write, so the first request pays no connection
    setup. (The probe counts as no KV sent: test_kv_bytes_and_computed_tokens_match_the_prompt.)"""
    prefill = stack.worker_ids("prefill")[0]
    name = "duet_kv_peer_connect_seconds_count"
    wait_until(lambda: stack.metrics(prefill).value(name, outcome="ok") == 1, 30,
               "the prefill worker's probe of the decode worker")
    assert stack.metrics(prefill).value(name, outcome="failed") == 0
    assert stack.metrics(prefill).value(name, outcome="refused") == 0
