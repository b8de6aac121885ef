"""gRPC TLS and mutual TLS (shared/security/grpc_tls.py) on the real router server, with
certificates made here: a client that does not trust the CA, one without a client
certificate (under mTLS), one with a certificate from another CA and a plaintext one are
all refused; the right one is served. Also the name override used to dial workers by IP."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from protos import duet_pb2, duet_pb2_grpc
from services.router.config import RouterConfig
from services.router.server import RouterServer
from shared.registry.config import RegistryConfig
from shared.registry.publisher import WorkerPublisher
from shared.registry.worker_info import WorkerInfo
from shared.security.grpc_tls import GrpcTlsConfig
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)
from tests.helpers.tls_certs import TestCA


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, other = TestCA(root / "ca"), TestCA(root / "other", name="not-duet-ca")
    return {
        "ca": ca,
        "server": ca.issue("server", "duet-router"),
        "client": ca.issue("client", "duet-gateway", server=False, dns=(), ips=()),
        "stranger": other.issue("stranger", "someone", server=False, dns=(), ips=()),
        "named": ca.issue("named", "duet-internal", dns=("duet-internal",), ips=()),
    }


def registry(url: str) -> RegistryConfig:
    return RegistryConfig(redis_url=url, ttl_s=2.0, heartbeat_interval_s=0.5, scan_interval_s=0.2)


async def route(address: str, tls: GrpcTlsConfig | None) -> duet_pb2.RouteReply:
    # a subchannel of its own: no connection shared with an earlier client's channel
    options = [("grpc.use_local_subchannel_pool", 1)]
    channel = tls.aio_channel(address, options) if tls is not None else grpc.aio.insecure_channel(address, options)
    async with channel:
        return await duet_pb2_grpc.RouterStub(channel).Route(duet_pb2.RouteRequest(prompt_tokens=5), timeout=5)


async def with_router(url: str, server_tls: GrpcTlsConfig, clients: dict[str, GrpcTlsConfig | None]) -> dict:
    """Start a router with server_tls and one live worker; each client's Route outcome:
    the chosen worker id, "refused" (no connection), or the error of an answered call."""
    pub = WorkerPublisher(WorkerInfo(worker_id="w", role="both", address="w:1", model="m", page_size=16),
                          registry(url))
    await pub.start()
    server = RouterServer(RouterConfig(host="127.0.0.1", port=0, metrics_port=0, model="m",
                                       registry=registry(url), tls=server_tls))
    await server.start()
    for _ in range(100):  # the router has seen the worker: a refusal below is the transport's
        if server.watcher.workers():
            break
        await asyncio.sleep(0.05)
    out = {}
    try:
        for name, tls in clients.items():
            try:
                out[name] = (await route(f"127.0.0.1:{server.port}", tls)).decode.worker_id
            except grpc.aio.AioRpcError as exc:
                # a transport refusal, not an answer from the router (which can also be UNAVAILABLE)
                refused = "failed to connect to all addresses" in (exc.details() or "")
                out[name] = "refused" if refused else f"{exc.code().name}: {exc.details()}"
    finally:
        await server.stop()
        await pub.stop()
    return out


def test_mutual_tls_refuses_every_client_but_the_one_with_a_ca_signed_certificate(pki, redis_server):
    s, c, st = pki["server"], pki["client"], pki["stranger"]
    server_tls = GrpcTlsConfig(cert_file=str(s.cert), key_file=str(s.key), ca_file=str(s.ca))
    outcome = asyncio.run(with_router(redis_server.url, server_tls, {
        "mtls": GrpcTlsConfig(cert_file=str(c.cert), key_file=str(c.key), ca_file=str(c.ca)),
        "no client cert": GrpcTlsConfig(ca_file=str(c.ca)),
        "cert from another CA": GrpcTlsConfig(cert_file=str(st.cert), key_file=str(st.key), ca_file=str(c.ca)),
        "does not trust the CA": GrpcTlsConfig(cert_file=str(c.cert), key_file=str(c.key), ca_file=str(st.ca)),
        "plaintext": None,
    }))
    assert outcome == {"mtls": "w", "no client cert": "refused", "cert from another CA": "refused",
                       "does not trust the CA": "refused", "plaintext": "refused"}


def test_server_tls_without_ca_serves_any_client_that_trusts_it(pki, redis_server):
    s, st = pki["server"], pki["stranger"]
    server_tls = GrpcTlsConfig(cert_file=str(s.cert), key_file=str(s.key))
    outcome = asyncio.run(with_router(redis_server.url, server_tls, {
        "tls": GrpcTlsConfig(ca_file=str(s.ca)),
        "system roots only": GrpcTlsConfig(cert_file=str(st.cert), key_file=str(st.key)),
        "plaintext": None,
    }))
    assert outcome == {"tls": "w", "system roots only": "refused", "plaintext": "refused"}


def test_server_name_override_checks_one_name_whatever_address_is_dialled(pki, redis_server):
    """Workers are dialled by pod IP: clients check the pool's one certificate name instead."""
    n = pki["named"]  # SAN: DNS duet-internal only, no IP
    server_tls = GrpcTlsConfig(cert_file=str(n.cert), key_file=str(n.key))
    outcome = asyncio.run(with_router(redis_server.url, server_tls, {
        "by name": GrpcTlsConfig(ca_file=str(n.ca), server_name="duet-internal"),
        "by ip": GrpcTlsConfig(ca_file=str(n.ca)),
        "wrong name": GrpcTlsConfig(ca_file=str(n.ca), server_name="duet-router"),
    }))
    assert outcome == {"by name": "w", "by ip": "refused", "wrong name": "refused"}


def test_config_flags_env_and_bad_files(pki, tmp_path):
    s = pki["server"]
    env = {"DUET_GRPC_TLS_CERT_FILE": str(s.cert), "DUET_GRPC_TLS_KEY_FILE": str(s.key),
           "DUET_GRPC_TLS_CA_FILE": str(s.ca)}
    config = RouterConfig.from_argv([], env)
    assert config.tls == GrpcTlsConfig(str(s.cert), str(s.key), str(s.ca)) and config.tls.mutual
    assert RouterConfig.from_argv([], {}).tls.describe("server") == "plaintext"
    with pytest.raises(ValueError, match="go together"):
        GrpcTlsConfig(cert_file=str(s.cert))
    with pytest.raises(ValueError, match="cannot read"):
        GrpcTlsConfig(cert_file=str(tmp_path / "nope.crt"), key_file=str(s.key)).check("server")
    (tmp_path / "junk.crt").write_text("not a certificate")
    with pytest.raises(ValueError, match="not PEM"):
        GrpcTlsConfig(ca_file=str(tmp_path / "junk.crt")).check("client")
    with pytest.raises(ValueError, match="needs --grpc-tls-cert-file"):
        GrpcTlsConfig(ca_file=str(s.ca)).check("server")
