"""`duet up` as it starts by default (mutual TLS on every gRPC link with a certificate per
child, Redis with a password), plus an API key and HTTPS at the gateway (certificates made
here with `cryptography`): the right key over HTTPS works with the official openai client; a
missing or wrong key gets 401 and no request reaches a worker (their token counters and the
gateway's request counter stay put); a client that does not trust the CA is refused.

What a hostile local process tried against an open stack, refused: calls to the router and
the workers in plaintext, over TLS without a client certificate or with another CA's; calls
with a genuine certificate of the wrong role (a worker's routing, reserving KV, prefilling:
PERMISSION_DENIED, nothing left in flight); forged registry entries pointing at gRPC servers
of its own (no request reaches them while real requests are served); Redis without the
password. The key is on no child's command line, in no log, and its 0600 file is gone after
shutdown."""
from __future__ import annotations

import json
import ssl
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import openai
import psutil
import pytest
import redis

from protos import duet_pb2, duet_pb2_grpc
from shared.security.identity import Identity, server_name
from tests.helpers.stack import DuetUp, Metrics, managed, new_log_dir, wait_until
from tests.helpers.tls_certs import CertFiles, TestCA

pytestmark = pytest.mark.slow

API_KEY = "sk-duet-e2e-7f3a9c1d5e8b2460"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("pki"))
    other = TestCA(tmp_path_factory.mktemp("other"), name="other-ca")
    return {"https": ca.issue("gateway-https", "duet-gateway", client=False),
            # another CA's certificates with the identities duet up's children have
            "stranger": other.issue_identity("stranger", Identity("gateway")),
            "stranger-decode-9": other.issue_identity("stranger-decode-9", Identity("decode", "decode-9"))}


@pytest.fixture(scope="module")
def stack(request, pki):
    h = pki["https"]
    up = DuetUp(new_log_dir("up-security"), "--api-key", API_KEY,
                "--tls-cert-file", str(h.cert), "--tls-key-file", str(h.key))
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


# --- gRPC and Redis: what a hostile local process tried ------------------------------------

LOCAL = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own per client


def target_calls(stack) -> dict[str, tuple[str, str, object]]:
    """For the router and each worker: (address, the name its certificate carries, a call of
    the method a hostile caller wants: Route, Reserve naming decode's pages, Prefill)."""
    workers = stack.workers()
    reserve = duet_pb2.ReserveRequest(request_id="hostile", prompt_tokens=8000, max_tokens=8000,
                                      prefill_worker_id="prefill-0")
    prefill = duet_pb2.PrefillRequest(request_id="hostile", prompt_token_ids=[1, 2, 3],
                                      reservation=duet_pb2.Reservation(decode_worker_id="decode-0", ranks=[
                                          duet_pb2.RankPages(page_ids=[1, 2, 3])]))
    return {
        "router": (stack.router_address, server_name("router"),
                   lambda ch: duet_pb2_grpc.RouterStub(ch).Route(duet_pb2.RouteRequest(prompt_tokens=5), timeout=10)),
        "decode-0": (workers["decode-0"]["address"], server_name("decode", "decode-0"),
                     lambda ch: duet_pb2_grpc.DecodeStub(ch).Reserve(reserve, timeout=10)),
        "prefill-0": (workers["prefill-0"]["address"], server_name("prefill", "prefill-0"),
                      lambda ch: duet_pb2_grpc.PrefillStub(ch).Prefill(prefill, timeout=10)),
    }


def outcome(channel, call) -> str:
    """"answered", "refused" (no connection: the handshake failed) or the error code and detail."""
    with channel:
        try:
            call(channel)
            return "answered"
        except grpc.RpcError as exc:
            if "failed to connect to all addresses" in (exc.details() or ""):
                return "refused"
            return f"{exc.code().name}: {exc.details()}"


def tls_channel(stack, address: str, name: str, cert=None, ca: Path | None = None):
    creds = grpc.ssl_channel_credentials((ca or stack.certs_dir / "grpc-ca.crt").read_bytes(),
                                         cert.key.read_bytes() if cert else None,
                                         cert.cert.read_bytes() if cert else None)
    return grpc.secure_channel(address, creds, options=LOCAL + [("grpc.ssl_target_name_override", name)])


def test_grpc_without_the_stacks_credentials_is_refused(stack, pki):
    assert stack.certs_dir is not None, "duet up runs mutual TLS by default"
    for target, (address, name, call) in target_calls(stack).items():
        assert outcome(grpc.insecure_channel(address, options=LOCAL), call) == "refused", target
        # TLS that trusts the stack's CA but shows no client certificate: mutual TLS refuses it
        assert outcome(tls_channel(stack, address, name), call) == "refused", target
        # a certificate naming the gateway, from another CA
        assert outcome(tls_channel(stack, address, name, pki["stranger"]), call) == "refused", target


def test_a_certificate_of_the_wrong_role_is_permission_denied(stack):
    calls = target_calls(stack)
    inflight = stack.router_metrics().value("duet_router_inflight_requests")
    for caller, target in (("decode-0", "router"), ("prefill-0", "router"), ("router", "router"),
                           ("prefill-0", "decode-0"), ("router", "decode-0"), ("decode-0", "prefill-0")):
        address, name, call = calls[target]
        got = outcome(stack.grpc_channel(address, name, as_child=caller), call)
        method = {"router": "Router/Route", "decode-0": "Decode/Reserve", "prefill-0": "Prefill/Prefill"}[target]
        assert got.startswith(f"PERMISSION_DENIED: /duet.v1.{method} refused to role {caller.split('-')[0]} "), \
            (caller, target, got)
        assert got.endswith("only gateway may call it"), got
    for _ in range(50):  # a flood of Routes from a worker's certificate leaves nothing in flight
        outcome(stack.grpc_channel(*calls["router"][:2], as_child="decode-0"), calls["router"][2])
    assert stack.router_metrics().value("duet_router_inflight_requests") == inflight
    # the gateway's certificate is let through (here to the router's own refusal of a bad request)
    got = outcome(stack.grpc_channel(calls["router"][0], calls["router"][1]),
                  lambda ch: duet_pb2_grpc.RouterStub(ch).Route(duet_pb2.RouteRequest(prompt_tokens=0), timeout=10))
    assert got == "INVALID_ARGUMENT: prompt_tokens must be positive"


class CountingServer:
    """A hostile gRPC server: TLS with the certificate it was given, no client certificate
    asked for, every call counted (and answered UNIMPLEMENTED)."""

    def __init__(self, cert, key: bytes | None = None):
        self.calls: list[str] = []
        calls = self.calls

        class Count(grpc.ServerInterceptor):
            def intercept_service(self, continuation, details):
                calls.append(details.method)
                return continuation(details)
        self.server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[Count()])
        creds = grpc.ssl_server_credentials([(key or cert.key.read_bytes(), cert.cert.read_bytes())])
        self.port = self.server.add_secure_port("127.0.0.1:0", creds)
        self.server.start()

    def close(self) -> None:
        self.server.stop(0)


def test_a_forged_registry_entry_receives_nothing_while_requests_are_served(stack, pki):
    """Entries written as anyone with Redis access could (copies of decode-0's, with their own
    id, address and instance nonce) pointing at servers of the test's own: one with another
    CA's certificate naming decode-9, and two with genuine certificates of the stack (prefill-0's,
    decode-0's) under ids that are not theirs. The router never trusts them, every chat is
    served, and the servers are asked for nothing."""
    certs = stack.certs_dir
    fakes = {"decode-9": CountingServer(pki["stranger-decode-9"]),
             "decode-8": CountingServer(CertFiles(certs / "prefill-0.crt", certs / "prefill-0.key", certs / "grpc-ca.crt")),
             "decode-7": CountingServer(CertFiles(certs / "decode-0.crt", certs / "decode-0.key", certs / "grpc-ca.crt"))}
    r = stack.redis()
    genuine = r.hgetall("duet:worker:decode-0")
    try:
        for wid, server in fakes.items():
            r.hset(f"duet:worker:{wid}", mapping={**genuine, "worker_id": wid, "instance_nonce": f"forged{wid}",
                                                  "address": f"127.0.0.1:{server.port}"})
            r.publish("duet:workers:events", json.dumps({"event": "join", "worker_id": wid}))
        router_log = stack.log_dir / "router.log"
        wait_until(lambda: all(f"registry entry {wid} (decode at 127.0.0.1:{fakes[wid].port}) not trusted"
                               in router_log.read_text() for wid in fakes), 30, "the router to check the entries")
        c = client(stack, pki, API_KEY)
        for i in range(6):
            out = c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": f"Say {i}."}])
            assert out.usage.completion_tokens > 0
        assert {wid: s.calls for wid, s in fakes.items()} == {wid: [] for wid in fakes}
    finally:
        r.delete(*(f"duet:worker:{wid}" for wid in fakes))
        for server in fakes.values():
            server.close()


def test_redis_refuses_a_client_without_the_password(stack):
    assert stack.redis_password and set(stack.workers()) == {"prefill-0", "decode-0"}  # with it: both registered
    plain = stack.redis_url.replace(f":{stack.redis_password}@", "")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(plain, socket_timeout=5).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(plain.replace("redis://", "redis://:wrong@"), socket_timeout=5).ping()
    for proc in psutil.Process(stack.proc.pid).children(recursive=True):  # the password is on no command line
        assert stack.redis_password not in " ".join(proc.cmdline())


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
    assert "gRPC    mutual TLS" in stack.proc.log_text() and "API key required" in stack.proc.log_text()
    stack.close()  # the secrets folder goes with duet up
    assert not keys_file.exists() and not keys_file.parent.exists()
