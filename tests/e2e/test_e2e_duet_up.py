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

import httpx
import openai
import pytest

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.openai_schema import validate
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
def split_stack(request):
    with managed(request, DuetUp(new_log_dir("up-split")).start()) as stack:
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


def test_kv_bytes_and_computed_tokens_match_the_prompt(stack, tokenizer):
    """Prefill computes the prompt and sends its pages; decode receives exactly those bytes
    and computes only the new tokens. Asked again: the decode worker holds the prompt's full
    pages now (it kept what it decoded, and its KV events say so), so the router has it
    prefill the rest itself: nothing moves, decode computes only the last partial page."""
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
        pages_before = stack.redis().smembers(f"duet:worker:{decode}:pages")
        result = stack.client().completions.create(model=served_model(stack), prompt=prompt, max_tokens=8,
                                                   temperature=0)
        texts.append(result.choices[0].text)
        assert result.usage.prompt_tokens == len(ids)
        cached = result.usage.prompt_tokens_details.cached_tokens or 0
        assert cached == (0 if attempt == 0 else full), cached
        completion = result.usage.completion_tokens

        def delta(worker, name, **labels):
            return stack.metrics(worker).value(name, **labels) - before[worker].value(name, **labels)

        # counters are refreshed by the workers' load loop: wait for the decode side
        wait_until(lambda: delta(decode, "duet_engine_tokens_computed_total", phase="decode") >= completion - 1,
                   10, "decode's computed-token counter")
        sent = delta(prefill, "duet_kv_transfer_bytes_total", direction="sent")
        received = delta(decode, "duet_kv_transfer_bytes_total", direction="received")
        assert delta(decode, "duet_kv_recomputes_total") == 0
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
            # before asking again, the router must see that decode holds the prompt's pages
            # (the hashes are seeded with the gateway's keyed cache namespace, which the test
            # cannot make: count them instead, at least the prompt's full pages)
            wait_until(lambda: len(stack.redis().smembers(f"duet:worker:{decode}:pages") - pages_before)
                       >= full // PAGE_SIZE, 10, "decode's KV events in the registry")
        else:  # local prefill on decode: no prefill worker, no transfer
            assert sent == received == 0, (sent, received)
            assert delta(prefill, "duet_engine_tokens_computed_total", phase="prefill") == 0
            assert delta(decode, "duet_engine_tokens_computed_total", phase="prefill") == len(ids) - full
            assert delta(decode, "duet_engine_tokens_computed_total", phase="decode") == completion - 1
            assert delta(decode, "duet_kv_cache_hit_tokens_total", tier="device") == full
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
