"""LoRA adapters at the gateway over its in-process engine (`--backend local`; CPU, the default
model, a random PEFT adapter), real uvicorn, the official openai client and plain HTTP.

- /v1/models lists the base model and each adapter with the base as `parent`; /v1/models/NAME
  answers an adapter's card; `model` picks the adapter (the answer names it) and a name nobody
  serves is a 404 model_not_found in OpenAI's format.
- POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and answers): loaded
  adapters serve at once, bad bodies and folders are 400s naming the field, unloading an
  unknown adapter is a 404; off (404, saying how to turn them on) unless enabled, and a gateway
  whose engine has no LoRA slots says so."""
from __future__ import annotations

import httpx
import openai
import pytest

from services.gateway.backends.local_engine import LocalBackend
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from tests.helpers.gateway_support import UvicornThread
from tests.helpers.lora_adapters import save_random_adapter
from tests.helpers.openai_schema import validate

MODEL = "smollm2"
CONTEXT = 1024


@pytest.fixture(scope="module")
def model_dir():
    from shared.model_files.default_model import ensure_default_model
    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway-lora")
    return {"tone": save_random_adapter(model_dir, root / "tone", rank=4, seed=5),
            "sql": save_random_adapter(model_dir, root / "sql", rank=8, seed=6, targets=("q_proj", "v_proj"))}


def _serve(model_dir, backend, lora_loading: bool, manage_backend: bool = True):
    ctx = GatewayContext(backend, PromptBuilder.from_model_dir(model_dir), GatewayMetrics(), MODEL, CONTEXT,
                         lora_loading=lora_loading)
    return UvicornThread(build_app(ctx, manage_backend=manage_backend))


@pytest.fixture(scope="module")
def backend(model_dir, adapters):
    def load():
        from shared.engine import Engine, EngineConfig
        from shared.engine.lora.config import LoraConfig
        return Engine(EngineConfig(model_dir=str(model_dir), max_model_len=CONTEXT, kv_cache_memory=64 << 20,
                                   lora=LoraConfig(adapters=[f"tone={adapters['tone']}"], max_loras=2)))
    return LocalBackend(load, name=MODEL, expected_context_len=CONTEXT)


@pytest.fixture(scope="module")
def server(model_dir, backend):
    with _serve(model_dir, backend, lora_loading=True) as srv:
        assert backend.wait_loaded(120), f"engine did not load: {backend.load_error}"
        yield srv


def _client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.base_url + "/v1" + path, json=body, timeout=60)


def _complete(client, model: str) -> tuple[str, str]:
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    return r.model, r.choices[0].text


def test_models_list_and_resolve_adapters(server):
    client = _client(server)
    cards = {m.id: m.model_extra for m in client.models.list()}
    assert set(cards) == {MODEL, "tone"} and cards["tone"]["parent"] == MODEL and cards[MODEL]["parent"] is None
    assert httpx.get(server.base_url + "/v1/models/tone").json()["parent"] == MODEL
    assert httpx.get(server.base_url + "/v1/models/nope").json()["error"]["code"] == "model_not_found"
    base, tone = _complete(client, MODEL), _complete(client, "tone")
    assert base[0] == MODEL and tone[0] == "tone" and tone[1] != base[1]
    assert _complete(client, "tone") == tone
    chat = client.chat.completions.create(model="tone", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.model == "tone"
    with pytest.raises(openai.NotFoundError) as err:
        _complete(client, "sql")
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
    assert err.value.body["message"] == "The model `sql` does not exist."
    # the gateway's series carry the adapter beside its base model
    metrics = httpx.get(server.base_url + "/metrics").text
    assert f'duet_prompt_tokens_total{{adapter="tone",endpoint="completions",model="{MODEL}"}}' in metrics
    assert f'duet_time_to_first_token_seconds_count{{adapter="",endpoint="completions",model="{MODEL}"}}' in metrics


def test_load_and_unload_at_run_time(server, adapters):
    client = _client(server)
    for body, param in (({"lora_path": "/x"}, "lora_name"), ({"lora_name": "sql"}, "lora_path"),
                        ({"lora_name": "has space", "lora_path": "/x"}, "lora_name"),
                        ({"lora_name": "sql", "lora_path": "/no/such/folder"}, "lora_path")):
        bad = _post(server, "/load_lora_adapter", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    for taken, why in ((MODEL, "the name of a served model"), ("tone", "already been loaded")):
        again = _post(server, "/load_lora_adapter", {"lora_name": taken, "lora_path": str(adapters["sql"])})
        assert again.status_code == 400 and why in again.json()["error"]["message"], again.text
    for base, status in (("no-such-model", 404), (7, 400)):  # the base model: a served one's name
        wrong = _post(server, "/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"]),
                                                     "base_model": base})
        assert wrong.status_code == status and wrong.json()["error"]["param"] == "base_model", wrong.text
        validate(wrong.json(), "ErrorResponse")
    ok = _post(server, "/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"]),
                                              "base_model": MODEL})
    assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'sql' added successfully."
    assert {m.id for m in client.models.list()} == {MODEL, "tone", "sql"}
    model, text = _complete(client, "sql")
    assert model == "sql" and text != _complete(client, MODEL)[1]
    gone = _post(server, "/unload_lora_adapter", {"lora_name": "sql"})
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'sql' removed successfully."
    assert {m.id for m in client.models.list()} == {MODEL, "tone"}
    missing = _post(server, "/unload_lora_adapter", {"lora_name": "sql"})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "The lora adapter 'sql' cannot be found."


def test_loading_is_off_unless_enabled_and_needs_lora_slots(server, model_dir, backend, adapters):
    body = {"lora_name": "sql", "lora_path": str(adapters["sql"])}
    with _serve(model_dir, backend, lora_loading=False, manage_backend=False) as off:
        refused = _post(off, "/load_lora_adapter", body)
        assert refused.status_code == 404 and "--enable-lora-loading" in refused.json()["error"]["message"]
        assert _post(off, "/unload_lora_adapter", {"lora_name": "tone"}).status_code == 404
        assert {m.id for m in _client(off).models.list()} == {MODEL, "tone"}  # serving them is not loading them

    def plain():
        from shared.engine import Engine, EngineConfig
        return Engine(EngineConfig(model_dir=str(model_dir), max_model_len=CONTEXT, kv_cache_memory=32 << 20))
    no_slots = LocalBackend(plain, name=MODEL, expected_context_len=CONTEXT)
    with _serve(model_dir, no_slots, lora_loading=True) as srv:
        assert no_slots.wait_loaded(120)
        answer = _post(srv, "/load_lora_adapter", body)
        assert answer.status_code == 400 and "--max-loras" in answer.json()["error"]["message"]
