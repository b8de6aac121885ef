"""The OpenAI API features through the gateway's in-process engine (the `local` backend, one
process), with the official openai client on a real uvicorn server, on a random-weight
model with SmolLM2's tokenizer (tests/helpers/openai_features.py says why)."""
from __future__ import annotations

import openai
import pytest

from services.gateway.backends.local_engine import LocalBackend
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from tests.helpers import openai_features as features
from tests.helpers.gateway_support import UvicornThread, wait_until

MODEL = "random"
CONTEXT = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return features.random_model_dir(tmp_path_factory.mktemp("features"))


@pytest.fixture(scope="module")
def backend(model_dir):
    def load():
        from shared.engine import Engine, EngineConfig
        return Engine(EngineConfig(model_dir=str(model_dir), max_model_len=CONTEXT, kv_cache_memory=64 << 20,
                                   num_threads=1))
    return LocalBackend(load, name=MODEL, expected_context_len=CONTEXT)


@pytest.fixture(scope="module")
def client(model_dir, backend):
    ctx = GatewayContext(backend, PromptBuilder.from_model_dir(model_dir), GatewayMetrics(), MODEL, CONTEXT)
    with UvicornThread(build_app(ctx)) as srv:
        assert backend.wait_loaded(120), f"engine did not load: {backend.load_error}"
        with openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            yield c


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(autouse=True)
def nothing_left(backend):
    yield

    def idle():
        def check(engine):
            engine.check_idle()
            return True
        try:
            return backend.call(check).result(10)
        except AssertionError:
            return False
    assert wait_until(idle, timeout=10), "the engine kept requests or pages"


def test_structured_outputs(client):
    features.check_structured_outputs(client, MODEL)
    features.check_bad_schema_is_400(client, MODEL)
    features.check_unenforceable_schemas_are_400(client, MODEL)


def test_tools(client):
    features.check_forced_tool_calls(client, MODEL)
    features.check_tool_conversation(client, MODEL)


def test_n_prompt_lists_logit_bias_echo(client, tokenizer):
    features.check_n_and_prompt_lists(client, MODEL)
    features.check_logit_bias(client, MODEL, tokenizer)
    features.check_echo(client, MODEL, tokenizer)


def test_responses(client):
    features.check_responses(client, MODEL)
