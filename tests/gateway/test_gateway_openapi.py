"""/openapi.json describes the request bodies the endpoints parse (what clients and the
fuzzer in tests/gateway/test_gateway_fuzz.py build requests from), and bodies made from it that
the document calls valid are what the parser takes."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from shared.openai_protocol.errors import InvalidRequest
from shared.openai_protocol.requests import parse_chat_request, parse_completion_request
from tests.helpers.gateway_support import ScriptedBackend, UvicornThread, byte_level_tokenizer_dir


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    prompts = PromptBuilder.from_model_dir(byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"), 256))
    backend = ScriptedBackend(script=[], eos_token_id=prompts.tokenizer.eos_token_id)
    with UvicornThread(build_app(GatewayContext(backend, prompts, GatewayMetrics(), "tiny", 256))) as srv:
        r = httpx.get(srv.base_url + "/openapi.json")
    assert r.status_code == 200
    return r.json()


def schema_of(doc: dict, path: str) -> dict:
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    name = ref.rsplit("/", 1)[-1]
    return {**doc["components"]["schemas"][name], "components": doc["components"]}


@pytest.mark.parametrize("path,body,valid", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, True),
    ("/v1/chat/completions", {"messages": []}, False),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, False),
    ("/v1/completions", {"prompt": "hi", "n": 2, "stop": ["x"]}, True),
    ("/v1/completions", {"prompt": [1, 2, 3]}, True),
    ("/v1/completions", {"prompt": ""}, False),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, False),
    ("/v1/completions", {"max_tokens": 3}, False),
])
def test_documented_bodies_agree_with_the_parser(doc, path, body, valid):
    schema = schema_of(doc, path)
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(body))
    assert (not errors) == valid, errors
    parse = parse_chat_request if "chat" in path else parse_completion_request
    if valid:
        parse(httpx.Request("POST", "/", json=body).content)
    else:
        with pytest.raises(InvalidRequest):
            parse(httpx.Request("POST", "/", json=body).content)


def test_error_answers_are_documented(doc):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "413", "429"} <= set(responses)
        assert responses["429"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
