"""`duet up` with an API key, HTTPS at the gateway and mutual TLS on every gRPC link
(certificates made here with `cryptography`): the right key over HTTPS works with the
official openai client; a missing or wrong key gets 401 and no request reaches a worker
(their token counters and the gateway's request counter stay put); a client that does not
trust the CA is refused; a gRPC client without a client certificate is refused by the
workers and the router; the key is on no child's command line, in no log, and its 0600
file is gone after shutdown."""
from __future__ import annotations

import asyncio
import re
import ssl
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.stack import DuetUp, Metrics, managed, new_log_dir
from tests.helpers.tls_certs import TestCA

pytestmark = pytest.mark.slow

API_KEY = "sk-duet-e2e-7f3a9c1d5e8b2460"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("pki"))
    return {"https": ca.issue("gateway-https", "duet-gateway", client=False),
            "grpc": ca.issue("grpc", "duet-internal"),  # server and client usage: every service
            "stranger": TestCA(tmp_path_factory.mktemp("other"), name="other-ca").issue("x", "x")}


@pytest.fixture(scope="module")
def stack(request, pki):
    h, g = pki["https"], pki["grpc"]
    up = DuetUp(new_log_dir("up-security"), "--api-key", API_KEY,
                "--tls-cert-file", str(h.cert), "--tls-key-file", str(h.key),
                "--grpc-tls-cert-file", str(g.cert), "--grpc-tls-key-file", str(g.key),
                "--grpc-tls-ca-file", str(g.ca))
    up.base_url = up.base_url.replace("http://", "https://")
    with managed(request, up.start()) as s:
        s.wait_ready()
        yield s


def trusted(pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki["https"].ca))


def client(stack, pki, key: str | None, verify=None) -> openai.OpenAI:
    http = httpx.Client(verify=verify if verify is not None else trusted(pki))
    return openai.OpenAI(base_url=stack.base_url, api_key=key or "", max_retries=0, timeout=120, http_client=http)


def gateway_metrics(stack, pki) -> Metrics:
    url = stack.base_url.removesuffix("/v1") + "/metrics"  # open: no key
    return Metrics.parse(httpx.get(url, verify=trusted(pki), timeout=10).text)


def work_done(stack, pki) -> dict[str, float]:
    """What any served request moves: tokens computed on each worker, gateway requests."""
    out = {w: stack.metrics(w).value("duet_engine_tokens_computed_total") for w in stack.worker_ids()}
    gm = gateway_metrics(stack, pki)
    out["gateway_requests"] = gm.value("duet_requests_total")
    out["gateway_prompt_tokens"] = gm.value("duet_prompt_tokens_total")
    return out


def test_right_key_over_https_works_with_the_openai_client(stack, pki):
    c = client(stack, pki, API_KEY)
    out = c.chat.completions.create(model=c.models.list().data[0].id, messages=MESSAGES, max_tokens=8, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens > 0
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=out.model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert text == out.choices[0].message.content


def test_missing_or_wrong_key_is_refused_before_any_work(stack, pki):
    c = client(stack, pki, API_KEY)
    c.completions.create(model=c.models.list().data[0].id, prompt="warm", max_tokens=2)  # counters exist
    before = work_done(stack, pki)
    assert all(v > 0 for v in before.values()), before
    failures = gateway_metrics(stack, pki).value("duet_gateway_auth_failures_total")
    with httpx.Client(base_url=stack.base_url.removesuffix("/v1"), verify=trusted(pki), timeout=30) as http:
        for method, path, body in (("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8}),
                                   ("POST", "/v1/completions", {"prompt": "Hello", "stream": True}),
                                   ("GET", "/v1/models", None)):
            r = http.request(method, path, json=body)  # no Authorization header at all
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    for key in ("sk-wrong", API_KEY[:-1], API_KEY + "0"):
        bad = client(stack, pki, key)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=8)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        assert info.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=8, stream=True)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert work_done(stack, pki) == before  # no request reached a worker, none was counted served
    assert gateway_metrics(stack, pki).value("duet_gateway_auth_failures_total") == failures + 12


def test_client_that_does_not_trust_the_ca_is_refused(stack, pki):
    for verify in (True, ssl.create_default_context(cafile=str(pki["stranger"].ca))):
        with pytest.raises(openai.APIConnectionError):
            client(stack, pki, API_KEY, verify=verify).models.list()
    with pytest.raises(httpx.TransportError):  # plain HTTP to the HTTPS port
        httpx.get(stack.base_url.replace("https://", "http://") + "/models", timeout=10)


def grpc_outcome(address: str, pki, *, ca: bool, client_cert) -> str:
    """A gRPC health check against `address`: SERVING, refused, or the error."""
    async def call():
        opts = [("grpc.use_local_subchannel_pool", 1)]
        if ca or client_cert:
            creds = grpc.ssl_channel_credentials(
                root_certificates=pki["grpc"].ca.read_bytes() if ca else None,
                private_key=client_cert.key.read_bytes() if client_cert else None,
                certificate_chain=client_cert.cert.read_bytes() if client_cert else None)
            channel = grpc.aio.secure_channel(address, creds, options=opts)
        else:
            channel = grpc.aio.insecure_channel(address, options=opts)
        async with channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as exc:
                if "failed to connect to all addresses" in (exc.details() or ""):
                    return "refused"
                return exc.code().name  # answered (e.g. UNIMPLEMENTED: the router has no health service)
    return asyncio.run(call())


def test_grpc_needs_a_client_certificate_signed_by_the_ca(stack, pki):
    workers = stack.workers()
    router = re.search(r"router\s+(\S+:\d+)", stack.proc.log_text()).group(1)
    assert len(workers) == 2
    for address in [w["address"] for w in workers.values()] + [router]:
        answered = "UNIMPLEMENTED" if address == router else "SERVING"
        assert grpc_outcome(address, pki, ca=True, client_cert=pki["grpc"]) == answered, address
        assert grpc_outcome(address, pki, ca=True, client_cert=None) == "refused", address
        assert grpc_outcome(address, pki, ca=True, client_cert=pki["stranger"]) == "refused", address
        assert grpc_outcome(address, pki, ca=False, client_cert=None) == "refused", address


def children(pid: int) -> list[int]:
    """Every descendant of pid (from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def test_key_is_on_no_child_command_line_nor_in_any_log(stack, pki):
    kids = children(stack.proc.pid)
    cmdlines = {k: Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                for k in kids if Path(f"/proc/{k}/cmdline").exists()}
    gateway = [k for k, line in cmdlines.items() if " gateway " in line]
    assert len(gateway) == 1 and len(cmdlines) >= 4, cmdlines
    for line in cmdlines.values():
        assert API_KEY not in line
    environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{gateway[0]}/environ").read_bytes().decode().split("\0")
                   if "=" in kv)
    assert API_KEY not in environ.get("DUET_API_KEYS", "")
    keys_file = Path(environ["DUET_API_KEYS_FILE"])
    assert keys_file.read_text().split() == [API_KEY]
    assert keys_file.stat().st_mode & 0o777 == 0o600 and keys_file.parent.stat().st_mode & 0o777 == 0o700
    with pytest.raises(openai.AuthenticationError):
        client(stack, pki, "sk-wrong-for-the-log").models.list()
    for log in stack.log_dir.iterdir():
        text = log.read_text(errors="replace")
        assert API_KEY not in text and "sk-wrong-for-the-log" not in text, log
    assert "mTLS" in stack.proc.log_text() and "API key required" in stack.proc.log_text()
    stack.close()  # the secrets folder goes with duet up
    assert not keys_file.exists() and not keys_file.parent.exists()
