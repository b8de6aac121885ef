"""Several base models behind one gateway (services/gateway/openai_api/served_model.py): each
request is tokenized with the tokenizer of the model it names and sent to the backend under that
model's name; /v1/models lists every model; a request naming none gets the default model; an
unknown name is OpenAI's 404 model_not_found; the token metrics carry the model.

Two real tokenizers that split text differently (a byte-level BPE and a sentencepiece-style
one), a real uvicorn server, the official openai client; the backend is a ScriptedBackend,
which records what reached it."""
from __future__ import annotations

import httpx
import openai
import pytest

from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from services.gateway.openai_api.served_model import ModelFiles
from tests.helpers.gateway_support import (
    ScriptedBackend,
    UvicornThread,
    byte_level_tokenizer_dir,
    sentencepiece_tokenizer_dir,
    wait_until,
)

PROMPT = "hello world, the quick brown fox"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    a = PromptBuilder.from_model_dir(byte_level_tokenizer_dir(tmp_path_factory.mktemp("a"), 256))
    b = PromptBuilder.from_model_dir(sentencepiece_tokenizer_dir(tmp_path_factory.mktemp("b")))
    return a, b


@pytest.fixture(scope="module")
def served(models):
    a, b = models
    backend = ScriptedBackend(script=[], eos_token_id=a.tokenizer.eos_token_id)
    ctx = GatewayContext(backend, a, GatewayMetrics(), "model-a", 256, extra_models=[ModelFiles("model-b", b, 128)])
    with UvicornThread(build_app(ctx)) as server:
        yield server, backend, ctx


def test_each_request_is_tokenized_and_routed_as_the_model_it_names(served, models):
    server, backend, _ = served
    a, b = models
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {"model-a", "model-b"}
    assert (cards["model-a"]["max_model_len"], cards["model-b"]["max_model_len"]) == (256, 128)
    assert a.text_prompt_ids(PROMPT) != b.text_prompt_ids(PROMPT)  # the two tokenizers differ

    for name, builder in (("model-b", b), ("model-a", a), (None, a)):
        backend.requests.clear()
        args = {"model": name} if name else {}
        out = httpx.post(server.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **args},
                         timeout=30).json()
        assert out["model"] == (name or "model-a")
        [request] = backend.requests
        assert request.model == (name or "model-a")
        assert request.prompt_token_ids == builder.text_prompt_ids(PROMPT)
        assert out["usage"]["prompt_tokens"] == len(builder.text_prompt_ids(PROMPT))

    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert 'duet_prompt_tokens_total{adapter="",endpoint="completions",model="model-b"}' in metrics


def test_context_length_and_unknown_names_are_per_model(served):
    server, _, _ = served
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="model-c", prompt=PROMPT, max_tokens=2)
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
    assert httpx.get(server.base_url + "/v1/models/model-b", timeout=10).json()["max_model_len"] == 128
    # 200 tokens fit model-a's 256 but not model-b's 128
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="model-b", prompt=PROMPT, max_tokens=200)
    client.completions.create(model="model-a", prompt=PROMPT, max_tokens=200)


def test_two_models_may_not_share_a_name(models):
    a, b = models
    with pytest.raises(ValueError, match="model-a"):
        GatewayContext(ScriptedBackend(script=[], eos_token_id=0), a, GatewayMetrics(), "model-a", 256,
                       extra_models=[ModelFiles("model-a", b, 128)])


def test_the_planner_of_one_model_reads_that_models_arrivals_and_waiting_prompts(served):
    """A gateway's own /metrics page, read as the planner of model-b reads it (services/planner/
    scrape.py): the requests of model-b that reached it (a stream among them; a 400 is the
    request's own fault, no load; a name nobody serves is no model's), none of model-a's, and
    each model's waiting prompts."""
    from services.planner.scrape import gateway_figures

    server, _, _ = served
    url = server.base_url + "/v1/completions"

    def page() -> dict[str, dict[str, float]]:
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
        return {m: gateway_figures(text, m) for m in ("model-a", "model-b")}

    before = page()
    ok = {"model": "model-b", "prompt": PROMPT, "max_tokens": 2}
    assert httpx.post(url, json=ok, timeout=30).status_code == 200
    with httpx.stream("POST", url, json={**ok, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    assert httpx.post(url, json={**ok, "max_tokens": 500}, timeout=30).status_code == 400
    assert httpx.post(url, json={**ok, "model": "model-c"}, timeout=30).status_code == 404
    after = page()
    grew = {m: {k: after[m][k] - before[m][k] for k in ("finished", "inflight", "waiting_prompt_tokens")}
            for m in after}
    assert grew == {"model-a": {"finished": 0.0, "inflight": 0.0, "waiting_prompt_tokens": 0.0},
                    "model-b": {"finished": 2.0, "inflight": 0.0, "waiting_prompt_tokens": 0.0}}, grew
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert 'duet_gateway_waiting_prompt_tokens{model="model-a"} 0.0' in text
    assert 'duet_gateway_waiting_prompt_tokens{model="model-b"} 0.0' in text


class TwoPools(ScriptedBackend):
    """Each model's workers: one `both` worker running at most two sequences. Records the order
    in which requests reach the workers and how many of each model ran at once."""

    def live_capacity(self, model: str | None = None) -> list:
        from services.gateway.backends.capacity import WorkerCapacity
        one = [WorkerCapacity("both", 64, 16, 2, 256)]
        return one if model is not None else one + one

    def generate(self, request):
        self.by_model = getattr(self, "by_model", {})
        self.peaks = getattr(self, "peaks", {})
        inner = super().generate(request)

        async def counted():
            self.by_model[request.model] = self.by_model.get(request.model, 0) + 1
            self.peaks[request.model] = max(self.peaks.get(request.model, 0), self.by_model[request.model])
            try:
                async for event in inner:
                    yield event
            finally:
                self.by_model[request.model] -= 1
        return counted()


def test_each_model_is_admitted_against_its_own_workers(models):
    """Four requests of model-a fill its worker's batch of two (the other two wait at the
    gateway); a model-b request sent after them reaches model-b's idle worker at once, ahead
    of model-a's waiting ones, instead of waiting for room the gateway counted as one budget."""
    import concurrent.futures

    a, b = models
    backend = TwoPools(script=[5] * 100, eos_token_id=a.tokenizer.eos_token_id, delay_s=0.02)
    ctx = GatewayContext(backend, a, GatewayMetrics(), "model-a", 256, extra_models=[ModelFiles("model-b", b, 128)])

    def ask(model: str, **extra) -> int:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 100 if model == "model-a" else 20, **extra}
        return httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).status_code

    with UvicornThread(build_app(ctx)) as server, concurrent.futures.ThreadPoolExecutor(5) as pool:
        first = [pool.submit(ask, "model-a") for _ in range(4)]
        assert wait_until(lambda: len(backend.requests) >= 2 and ctx.admission.queued >= 2, timeout=10)
        late = pool.submit(ask, "model-b")
        assert [f.result() for f in first] + [late.result()] == [200] * 5
        # more than model-a's one worker could ever hold (8 x 200 tokens, 1024 in its pool): a 400
        # after its model resolved, counted for model-a as the client's own error, not as load
        assert ask("model-a", n=8, max_tokens=200) == 400
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
    order = [r.model for r in backend.requests]
    assert order.index("model-b") < 4, order  # before model-a's third and fourth
    assert backend.peaks == {"model-a": 2, "model-b": 1}, backend.peaks  # each pool's own batch bound
    assert ctx.admission.running.sequences == 0 and ctx.admission.queued == 0
    assert 'duet_gateway_model_requests_total{model="model-a",status="400"} 1.0' in text
    assert 'duet_gateway_model_inflight_requests{model="model-a"} 0.0' in text
    assert 'duet_gateway_model_requests_total{model="model-b",status="200"} 1.0' in text
