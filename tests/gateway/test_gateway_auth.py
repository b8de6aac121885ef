"""API keys, HTTPS and the separate metrics port at the gateway.

In process: the gateway app over a real uvicorn server (a ScriptedBackend records what
reaches it) with the key check installed, driven by the official openai client and raw
HTTP. As a process: `duet gateway` itself (services/gateway/main.py) with keys from a
file and the environment, HTTPS with certificates made here, /metrics on its own port, and
debug logging, whose output must never contain a key. The whole stack under keys and TLS
is tests/e2e/test_e2e_security.py."""
from __future__ import annotations

import os
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from services.gateway.http_edge import auth
from services.gateway.http_edge.app import build_app
from services.gateway.http_edge.metrics import GatewayMetrics
from services.gateway.http_edge.security_config import SecurityConfig
from services.gateway.openai_api.endpoints import GatewayContext
from services.gateway.openai_api.prompt_builder import PromptBuilder
from tests.helpers.stack import Metrics
from tests.helpers.gateway_support import ScriptedBackend, byte_level_tokenizer_dir, free_port, wait_until
from tests.helpers.tls_certs import TestCA

MODEL = "tiny"
CONTEXT = 256
MESSAGES = [{"role": "user", "content": "Say hello"}]
STATIC_KEY = "sk-duet-static-0123456789abcdef"
FILE_KEY = "sk-duet-file-fedcba9876543210"
REPO = Path(__file__).resolve().parents[2]


class Server:
    """uvicorn in a thread, HTTP or HTTPS (the gateway's own ssl options)."""

    def __init__(self, app, ssl_options: dict | None = None):
        import uvicorn

        self.port = free_port()
        self.scheme = "https" if ssl_options else "http"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=2, **(ssl_options or {})))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"), CONTEXT)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, other = TestCA(root / "ca"), TestCA(root / "other", name="other-ca")
    return {"server": ca.issue("server", "duet-gateway"),
            "client": ca.issue("client", "a-client", server=False, dns=(), ips=()),
            "stranger": other.issue("stranger", "stranger", server=False, dns=(), ips=())}


def make_app(tokenizer_dir, keys_file: Path | None, **app_kwargs):
    prompts = PromptBuilder.from_model_dir(tokenizer_dir)
    backend = ScriptedBackend(script=prompts.tokenizer.encode("Hello!", add_special_tokens=False),
                              eos_token_id=prompts.tokenizer.eos_token_id, max_context_len=CONTEXT)
    ctx = GatewayContext(backend, prompts, GatewayMetrics(), MODEL, CONTEXT)
    app = build_app(ctx, **app_kwargs)
    store = auth.ApiKeyStore([STATIC_KEY], str(keys_file) if keys_file else None)
    auth.install(app, store, ctx.metrics.registry)
    return app, backend, ctx, store


def client(base_url: str, key: str | None, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key or "", max_retries=0, timeout=30, **kwargs)


# --- the key store --------------------------------------------------------------------------

def test_keys_file_comments_bad_lines_and_rotation(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# team keys\n\n  {FILE_KEY}  \nsk-second\n")
    store = auth.ApiKeyStore([], str(f), recheck_s=0)
    assert store.count == 2 and store.matches(FILE_KEY.encode()) and store.matches(b"sk-second")
    assert not store.matches(b"sk-second ") and not store.matches(b"") and not store.matches(FILE_KEY[:-1].encode())
    f.write_text("sk-rotated\n")  # a Secret update
    assert store.matches(b"sk-rotated") and not store.matches(FILE_KEY.encode())
    f.write_text("\n")  # an empty file never locks everyone out: the previous keys stay
    assert store.matches(b"sk-rotated")
    f.write_text("good\nhas a space\n")
    with pytest.raises(ValueError) as info:
        auth.ApiKeyStore([], str(f))
    assert "line 2" in str(info.value) and "has a space" not in str(info.value)
    with pytest.raises(ValueError, match="cannot read"):
        auth.ApiKeyStore([], str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no API keys"):
        auth.ApiKeyStore([], str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="printable ASCII"):
        auth.ApiKeyStore(["bad key"])
    assert STATIC_KEY not in repr(SecurityConfig(api_keys=[STATIC_KEY]))


def test_security_flags_and_env(tmp_path):
    from services.gateway.config import GatewayConfig

    env = {"DUET_API_KEYS": "k1, k2", "DUET_API_KEYS_FILE": "/run/keys", "DUET_TLS_CERT_FILE": "/c",
           "DUET_TLS_KEY_FILE": "/k", "DUET_METRICS_PORT": "9102", "DUET_GRPC_TLS_CA_FILE": "/ca"}
    sec = GatewayConfig.from_argv(["--api-key", "k3"], env).security
    assert sec.api_keys == ["k1", "k2", "k3"] and sec.api_keys_file == "/run/keys"
    assert sec.https and sec.metrics_port == 9102 and sec.grpc_tls.ca_file == "/ca" and sec.auth_enabled
    assert not GatewayConfig.from_argv([], {}).security.auth_enabled
    with pytest.raises(ValueError, match="go together"):
        GatewayConfig.from_argv(["--tls-cert-file", "/c"], {})


# --- the check in front of the app ----------------------------------------------------------

def test_missing_or_wrong_key_is_401_and_reaches_nothing(tokenizer_dir, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(FILE_KEY + "\n")
    app, backend, ctx, _ = make_app(tokenizer_dir, keys_file)
    with Server(app) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_api_key", None)
        assert "Authorization: Bearer" in err["message"]
        for headers in ({"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {STATIC_KEY}"},
                        {"Authorization": "Bearer"}, {"Authorization": f"Bearer {STATIC_KEY}x"}):
            r = http.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
            assert STATIC_KEY not in r.text
        # every route but the open ones, unknown paths included (no probing for routes)
        for path in ("/v1/models", f"/v1/models/{MODEL}", "/v1/nope", "/docs"):
            assert http.get(path).status_code == 401, path
        with pytest.raises(openai.AuthenticationError) as info:
            client(srv.base_url, "sk-wrong").chat.completions.create(model=MODEL, messages=MESSAGES)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(srv.base_url, "sk-wrong").completions.create(model=MODEL, prompt="hi", stream=True)
        assert backend.requests == []  # nothing was generated
        metrics = Metrics.parse(http.get("/metrics").text)  # open, no key
        assert metrics.value("duet_gateway_auth_failures_total", reason="missing") == 5  # the POST and the four GETs
        assert metrics.value("duet_gateway_auth_failures_total", reason="invalid") == 6
        assert metrics.value("duet_requests_total") == 0 and metrics.value("duet_prompt_tokens_total") == 0
        assert http.get("/live").json() == {"status": "alive"}
        assert wait_until(lambda: http.get("/health").status_code == 200, 60)  # once the template helper is up


def test_right_key_works_with_the_openai_client(tokenizer_dir, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(FILE_KEY + "\n")
    app, backend, _, store = make_app(tokenizer_dir, keys_file)
    with Server(app) as srv:
        for key in (STATIC_KEY, FILE_KEY):
            out = client(srv.base_url, key).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20)
            assert out.choices[0].message.content == "Hello!"
        chunks = list(client(srv.base_url, FILE_KEY).completions.create(model=MODEL, prompt="x", stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello!"
        assert [m.id for m in client(srv.base_url, STATIC_KEY).models.list()] == [MODEL]
        assert len(backend.requests) == 3
        store.recheck_s = 0  # rotation: the file's new key works, its old one no longer does
        keys_file.write_text("sk-next-key\n")
        assert client(srv.base_url, "sk-next-key").models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            client(srv.base_url, FILE_KEY).models.list()


# --- HTTPS ------------------------------------------------------------------------------

def https_context(ca: Path | None, cert=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    return ctx


def test_https_needs_the_ca_and_client_certificates_when_asked(tokenizer_dir, pki):
    s = pki["server"]
    app, _, _, _ = make_app(tokenizer_dir, None)
    with Server(app, SecurityConfig(tls_cert_file=str(s.cert), tls_key_file=str(s.key)).uvicorn_ssl_kwargs()) as srv:
        good = client(srv.base_url, STATIC_KEY, http_client=httpx.Client(verify=https_context(s.ca)))
        assert good.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message.content == "Hello!"
        with pytest.raises(openai.APIConnectionError):  # system roots: our CA is unknown
            client(srv.base_url, STATIC_KEY).models.list()
        with pytest.raises(openai.APIConnectionError):  # plain HTTP to the HTTPS port
            client(srv.base_url.replace("https", "http"), STATIC_KEY).models.list()
    mtls = SecurityConfig(tls_cert_file=str(s.cert), tls_key_file=str(s.key), tls_client_ca_file=str(s.ca))
    app, _, _, _ = make_app(tokenizer_dir, None)
    with Server(app, mtls.uvicorn_ssl_kwargs()) as srv:
        with_cert = httpx.Client(verify=https_context(s.ca, pki["client"]))
        assert client(srv.base_url, STATIC_KEY, http_client=with_cert).models.list().data[0].id == MODEL
        for cert in (None, pki["stranger"]):
            with pytest.raises(openai.APIConnectionError):
                client(srv.base_url, STATIC_KEY, http_client=httpx.Client(verify=https_context(s.ca, cert))).models.list()


# --- `duet gateway` as a process ------------------------------------------------------------

def test_gateway_process_keys_https_metrics_port_and_no_key_in_logs(tokenizer_dir, pki, tmp_path):
    s = pki["server"]
    keys_file = tmp_path / "keys"
    keys_file.write_text(FILE_KEY + "\n")
    keys_file.chmod(0o600)
    port, metrics_port = free_port(), free_port()
    env_key = "sk-duet-env-5555aaaa5555"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DUET_API_KEYS": env_key, "DUET_API_KEYS_FILE": str(keys_file),
           "DUET_DRAIN_GRACE": "2", "DUET_LOG_LEVEL": "debug"}
    log_path = tmp_path / "gateway.log"
    argv = [sys.executable, "-m", "services.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
            "--router-address", "127.0.0.1:1", "--model", str(tokenizer_dir), "--served-model-name", MODEL,
            "--tls-cert-file", str(s.cert), "--tls-key-file", str(s.key), "--metrics-port", str(metrics_port),
            "--log-level", "debug"]  # DUET_LOG_LEVEL: `duet`'s own logging setup reads it
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"https://127.0.0.1:{port}"
    try:
        http = httpx.Client(base_url=base, verify=https_context(s.ca), timeout=10)
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if http.get("/live").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        assert http.get("/health").status_code == 503  # open (no router), not 401
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        for key in (FILE_KEY, env_key):
            ok = client(base, key, http_client=httpx.Client(verify=https_context(s.ca)))
            assert [m.id for m in ok.models.list()] == [MODEL]
        assert http.get("/metrics").status_code == 404  # only on the metrics port
        scraped = Metrics.parse(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text)
        assert scraped.value("duet_gateway_auth_failures_total", reason="missing") == 1
        assert scraped.value("duet_gateway_auth_failures_total", reason="invalid") == 1
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert FILE_KEY not in cmdline and env_key not in cmdline
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    text = log_path.read_text()
    assert "2 API keys" in text and "https://127.0.0.1" in text and f"port {metrics_port}" in text, text
    for secret in (FILE_KEY, env_key, "Bearer nope"):
        assert secret not in text, f"a key reached the log:\n{text}"
