"""The prefix-cache namespace the gateway gives each request, and `cache_salt`.

In process: the gateway app over a real uvicorn server with two API keys and a shared salt;
a ScriptedBackend records the CacheScope of every request that reaches it. Two keys never
share a namespace; one key with two salts neither; an operator's shared salt does across keys;
two gateways with the same key file agree, with different ones they do not. `cache_salt` is
taken on chat completions, completions and Responses (the official openai client sends it in
`extra_body`), and a bad one is a 400 naming it. What the workers do with the namespace is
tests/engine/test_engine_cache_isolation.py and tests/e2e/test_e2e_cache_isolation.py."""
from __future__ import annotations

import openai
import pytest

from services.gateway.http_edge import auth
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.cache_namespace import CacheNamespaces
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from shared.openai_protocol.requests import MAX_CACHE_SALT_CHARS
from tests.helpers.gateway_support import ScriptedBackend, UvicornThread, byte_level_tokenizer_dir

MODEL = "tiny"
CONTEXT = 256
KEY_A = "sk-tenant-a-0123456789"
KEY_B = "sk-tenant-b-9876543210"
SHARED_SALT = "common-system-prompt"
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"), CONTEXT)


def gateway(tokenizer_dir, namespaces: CacheNamespaces):
    prompts = PromptBuilder.from_model_dir(tokenizer_dir)
    backend = ScriptedBackend(script=prompts.tokenizer.encode("Hi!", add_special_tokens=False),
                              eos_token_id=prompts.tokenizer.eos_token_id, max_context_len=CONTEXT)
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), MODEL, CONTEXT, cache_namespaces=namespaces)
    app = build_app(ctx)
    auth.install(app, auth.ApiKeyStore([KEY_A, KEY_B]), ctx.metrics.registry)
    return UvicornThread(app), backend


@pytest.fixture(scope="module")
def served(tokenizer_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "cache-key"
    key_file.write_text("a-secret-of-the-operator-0123456789\n")
    namespaces = CacheNamespaces.configured(str(key_file), [SHARED_SALT])
    server, backend = gateway(tokenizer_dir, namespaces)
    with server as srv:
        yield srv, backend, key_file


def client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=30)


def scope_of(srv, backend, key: str, endpoint: str = "chat", salt: str | None = None):
    extra = {"cache_salt": salt} if salt is not None else None
    c = client(srv, key)
    if endpoint == "chat":
        c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=extra)
    elif endpoint == "completions":
        c.completions.create(model=MODEL, prompt="Say hello", max_tokens=2, extra_body=extra)
    else:
        c.responses.create(model=MODEL, input="Say hello", max_output_tokens=2, extra_body=extra)
    return backend.requests[-1].cache_scope


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_tenants_and_salts_get_namespaces_of_their_own(served, endpoint):
    srv, backend, _ = served
    a, a_again = scope_of(srv, backend, KEY_A, endpoint), scope_of(srv, backend, KEY_A, endpoint)
    b = scope_of(srv, backend, KEY_B, endpoint)
    assert a == a_again and a.namespace != b.namespace and a.tenant != b.tenant
    a_salted = scope_of(srv, backend, KEY_A, endpoint, salt="alice-1")
    assert a_salted.namespace not in (a.namespace, scope_of(srv, backend, KEY_A, endpoint, salt="alice-2").namespace)
    assert a_salted == scope_of(srv, backend, KEY_A, endpoint, salt="alice-1") and a_salted.tenant == a.tenant
    assert scope_of(srv, backend, KEY_B, endpoint, salt="alice-1").namespace != a_salted.namespace
    shared_a = scope_of(srv, backend, KEY_A, endpoint, salt=SHARED_SALT)
    shared_b = scope_of(srv, backend, KEY_B, endpoint, salt=SHARED_SALT)
    assert shared_a.namespace == shared_b.namespace  # the operator's shared salt: one namespace for all
    assert shared_a.namespace not in (a.namespace, b.namespace) and (shared_a.tenant, shared_b.tenant) == (a.tenant, b.tenant)


def test_gateways_with_one_key_agree_and_with_another_do_not(served, tokenizer_dir):
    srv, backend, key_file = served
    mine = scope_of(srv, backend, KEY_A)
    assert CacheNamespaces.configured(str(key_file), [SHARED_SALT]).scope(*_tenant_of(KEY_A)) == mine
    assert CacheNamespaces.from_secret("another-operator-secret-000").scope(*_tenant_of(KEY_A)).namespace != mine.namespace
    assert CacheNamespaces.random().scope(*_tenant_of(KEY_A)).namespace != mine.namespace
    with pytest.raises(ValueError, match="at least 16"):
        CacheNamespaces.from_secret("short")


def _tenant_of(key: str) -> tuple[str, None]:
    return auth.tenant_name(key.encode()), None


@pytest.mark.parametrize("salt, why", [(7, "Invalid type"), ("", "non-empty"), (["a"], "Invalid type"),
                                       ("x" * (MAX_CACHE_SALT_CHARS + 1), "at most")])
def test_a_bad_cache_salt_is_a_400_naming_it(served, salt, why):
    srv, backend, _ = served
    c = client(srv, KEY_A)
    before = len(backend.requests)
    calls = (lambda: c.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"cache_salt": salt}),
             lambda: c.completions.create(model=MODEL, prompt="hi", extra_body={"cache_salt": salt}),
             lambda: c.responses.create(model=MODEL, input="hi", extra_body={"cache_salt": salt}))
    for call in calls:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == "cache_salt" and why in info.value.body["message"], info.value.body
    assert len(backend.requests) == before  # nothing reached the backend
