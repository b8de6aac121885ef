"""gRPC TLS, mutual TLS and identities (shared/security/) on the real router server and on
stand-in workers (a gRPC server with the health service, as a worker serves it), with
certificates naming identities as duet up's throwaway CA issues them (tests/helpers/tls_certs.py):

- transport: a client that does not trust the CA, one without a client certificate, one with
  a certificate from another CA, and a plaintext one are refused; the gateway's is served;
- roles: a certificate of the wrong role (a worker's calling Route, the router's calling
  Route) gets PERMISSION_DENIED naming the method and the role, and leaves nothing in flight;
  one naming no Duet role too; the health check is open to any certified caller;
- names: a client checks the name of the server it means (the router, worker <id> serving
  decode), never the address: another worker's certificate fails, a role-wide one passes
  for any id of its role and no other role;
- registry trust: the router routes only to entries whose worker proved its identity; forged
  entries (another CA's certificate, a genuine certificate of another worker) get no request."""
from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import duet_pb2, duet_pb2_grpc
from services.router.config import RouterConfig
from services.router.server import RouterServer
from shared.registry.config import RegistryConfig
from shared.registry.keys import RegistryKeys
from shared.registry.publisher import WorkerPublisher
from shared.registry.worker_info import WorkerInfo
from shared.security.grpc_tls import GrpcTlsConfig
from shared.security.identity import Identity, server_name
from tests.helpers.redis_server import redis_server  # noqa: F401  (fixture)
from tests.helpers.tls_certs import CertFiles, TestCA

LOCAL = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own per client


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, CertFiles]:
    root = tmp_path_factory.mktemp("pki")
    ca, other = TestCA(root / "ca"), TestCA(root / "other", name="not-duet-ca")
    identities = {"router": Identity("router"), "gateway": Identity("gateway"), "w": Identity("both", "w"),
                  "decode-0": Identity("decode", "decode-0"), "prefill-0": Identity("prefill", "prefill-0"),
                  "decode-pool": Identity("decode"),  # a role-wide certificate, as the k8s Secrets carry
                  "worker-3": Identity("worker", "worker-3"), "prefill-1": Identity("prefill", "prefill-1")}
    return {**{name: ca.issue_identity(name, i) for name, i in identities.items()},
            "stranger": other.issue_identity("stranger", Identity("gateway")),
            "stranger-decode-9": other.issue_identity("stranger-decode-9", Identity("decode", "decode-9")),
            "no-role": ca.issue("no-role", "duet-gateway", dns=(), ips=())}


def tls(files: CertFiles, *, ca: Path | None = None, client_cert: bool = True) -> GrpcTlsConfig:
    cert = str(files.cert) if client_cert else None
    key = str(files.key) if client_cert else None
    return GrpcTlsConfig(cert_file=cert, key_file=key, ca_file=str(ca or files.ca))


def registry(url: str) -> RegistryConfig:
    return RegistryConfig(redis_url=url, ttl_s=2.0, heartbeat_interval_s=0.5, scan_interval_s=0.2)


@contextlib.asynccontextmanager
async def stand_in_worker(server_tls: GrpcTlsConfig, answer_after_s: float = 0.0):
    """A gRPC server with the health service, behind the same guard as a worker; yields
    (port, the methods it was asked for). answer_after_s: each call waits this long first (a
    worker on a busy machine)."""
    asked: list[str] = []

    class Count(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            asked.append(details.method)
            await asyncio.sleep(answer_after_s)
            return await continuation(details)
    server = grpc.aio.server(interceptors=[Count(), *server_tls.interceptors()])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server_tls.add_port(server, "127.0.0.1:0")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield port, asked
    finally:
        await server.stop(0)


async def call(address: str, name: str, client: GrpcTlsConfig | None, method: str = "route") -> str:
    """One call: "ok: <detail>", "refused" (no connection: the handshake failed) or the error."""
    channel = client.aio_channel(address, name, LOCAL) if client else grpc.aio.insecure_channel(address, options=LOCAL)
    async with channel:
        try:
            if method == "route":
                reply = await duet_pb2_grpc.RouterStub(channel).Route(duet_pb2.RouteRequest(prompt_tokens=5), timeout=5)
                return f"ok: {reply.decode.worker_id}"
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return f"ok: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        except grpc.aio.AioRpcError as exc:
            if "failed to connect to all addresses" in (exc.details() or ""):
                return "refused"
            return f"{exc.code().name}: {exc.details()}"


@contextlib.asynccontextmanager
async def router_with_worker(url: str, server_tls: GrpcTlsConfig, worker_tls: GrpcTlsConfig):
    """A router (server_tls) and one live `both` worker "w" (a stand-in serving worker_tls)."""
    async with stand_in_worker(worker_tls) as (port, _):
        pub = WorkerPublisher(WorkerInfo(worker_id="w", role="both", address=f"127.0.0.1:{port}", model="m",
                                         page_size=16), registry(url))
        await pub.start()
        server = RouterServer(RouterConfig(host="127.0.0.1", port=0, metrics_port=0, model="m",
                                           registry=registry(url), tls=server_tls))
        await server.start()
        try:
            # the router sees (and under mTLS trusts) the worker: a refusal below is the transport's
            assert await server.watcher.wait_for(lambda w: w.workers(), 10)
            yield server
        finally:
            await server.stop()
            await pub.stop()


def test_mutual_tls_refuses_every_client_but_the_one_with_a_ca_signed_certificate(pki, redis_server):
    async def run():
        async with router_with_worker(redis_server.url, tls(pki["router"]), tls(pki["w"])) as router:
            address, name = f"127.0.0.1:{router.port}", server_name("router")
            return {who: await call(address, name, client) for who, client in {
                "gateway": tls(pki["gateway"]),
                "no client cert": tls(pki["gateway"], client_cert=False),
                "cert from another CA": tls(pki["stranger"], ca=pki["gateway"].ca),
                "does not trust the CA": tls(pki["gateway"], ca=pki["stranger"].ca),
                "plaintext": None,
            }.items()}
    assert asyncio.run(run()) == {"gateway": "ok: w", "no client cert": "refused", "cert from another CA": "refused",
                                  "does not trust the CA": "refused", "plaintext": "refused"}


def test_server_tls_without_ca_serves_any_client_that_trusts_it(pki, redis_server):
    async def run():
        server_tls = GrpcTlsConfig(cert_file=str(pki["router"].cert), key_file=str(pki["router"].key))
        assert server_tls.interceptors() == []  # no client certificates: no roles to check
        async with router_with_worker(redis_server.url, server_tls, GrpcTlsConfig()) as router:
            address, name = f"127.0.0.1:{router.port}", server_name("router")
            return {who: await call(address, name, client) for who, client in {
                "tls": tls(pki["router"], client_cert=False),
                "system roots only": GrpcTlsConfig(cert_file=str(pki["stranger"].cert),
                                                   key_file=str(pki["stranger"].key)),
                "plaintext": None}.items()}
    assert asyncio.run(run()) == {"tls": "ok: w", "system roots only": "refused", "plaintext": "refused"}


def test_each_role_may_call_only_what_it_needs(pki, redis_server):
    async def run():
        async with router_with_worker(redis_server.url, tls(pki["router"]), tls(pki["w"])) as router:
            address, name = f"127.0.0.1:{router.port}", server_name("router")
            routes = {who: await call(address, name, tls(pki[who])) for who in
                      ("gateway", "decode-0", "prefill-0", "router", "w", "no-role")}
            for _ in range(20):  # what a hostile worker's flood would have left in flight
                await call(address, name, tls(pki["decode-0"]))
            return routes, len(router.service.inflight)
    routes, inflight = asyncio.run(run())
    assert routes.pop("gateway") == "ok: w"
    assert routes.pop("no-role") == ("PERMISSION_DENIED: /duet.v1.Router/Route refused: the caller's certificate "
                                     "names no Duet role")
    for who, outcome in routes.items():
        role = {"decode-0": "decode", "prefill-0": "prefill", "router": "router", "w": "both"}[who]
        assert outcome == (f"PERMISSION_DENIED: /duet.v1.Router/Route refused to role {role} "
                           f"({Identity(role, '' if who == 'router' else who)}): only gateway may call it"), who
    assert inflight == 1  # the gateway's one Route; the refused ones left nothing behind


def test_a_client_checks_the_name_of_the_server_it_means(pki):
    """Workers are dialled at addresses from the registry: the certificate must name the
    worker and the service, whatever the address."""
    async def run():
        out = {}
        for server, names in {"decode-0": [("decode", "decode-0"), ("decode", "decode-1"), ("prefill", "decode-0"),
                                           ("router", "")],
                              "decode-pool": [("decode", "decode-0"), ("decode", "decode-7f9c2"),
                                              ("prefill", "prefill-0")],
                              "w": [("decode", "w"), ("prefill", "w"), ("decode", "decode-0")]}.items():
            async with stand_in_worker(tls(pki[server])) as (port, asked):
                for service, worker_id in names:
                    outcome = await call(f"127.0.0.1:{port}", server_name(service, worker_id), tls(pki["gateway"]),
                                         method="health")
                    out[(server, service, worker_id)] = outcome
                # the guard lets any certified caller ask for health (the router's trust probe)
                out[(server, "as decode-0")] = await call(f"127.0.0.1:{port}", server_name("decode", "decode-0"),
                                                          tls(pki["decode-0"]), method="health")
                assert len(asked) == sum(o.startswith("ok") for k, o in out.items() if k[0] == server)
        return out
    out = asyncio.run(run())
    ok = "ok: SERVING"
    assert out == {
        ("decode-0", "decode", "decode-0"): ok, ("decode-0", "decode", "decode-1"): "refused",
        ("decode-0", "prefill", "decode-0"): "refused", ("decode-0", "router", ""): "refused",
        ("decode-0", "as decode-0"): ok,
        ("decode-pool", "decode", "decode-0"): ok, ("decode-pool", "decode", "decode-7f9c2"): ok,
        ("decode-pool", "prefill", "prefill-0"): "refused", ("decode-pool", "as decode-0"): ok,
        ("w", "decode", "w"): ok, ("w", "prefill", "w"): ok, ("w", "decode", "decode-0"): "refused",
        ("w", "as decode-0"): "refused"}  # asked for decode-0, w's certificate does not name it


def test_router_routes_only_to_entries_whose_worker_proved_its_identity(pki, redis_server):
    """Forged entries: a server with another CA's certificate naming decode-9, and the genuine
    certificate of prefill-0 and of decode-0 behind ids that are not theirs. The router probes
    each (a health check naming the worker it claims to be), never trusts one, and sends every
    Route to the real worker; the forged servers are asked for nothing at all."""
    url = redis_server.url

    async def run():
        keys = RegistryKeys("duet")
        forged = {"decode-9": pki["stranger-decode-9"], "decode-8": pki["prefill-0"], "decode-7": pki["decode-0"]}
        async with contextlib.AsyncExitStack() as stack:
            real_port, real_asked = await stack.enter_async_context(stand_in_worker(tls(pki["w"])))
            fakes = {wid: await stack.enter_async_context(stand_in_worker(tls(files))) for wid, files in forged.items()}
            real = WorkerPublisher(WorkerInfo(worker_id="w", role="both", address=f"127.0.0.1:{real_port}", model="m",
                                              page_size=16), registry(url))
            await real.start()
            stack.push_async_callback(real.stop)
            client = aioredis.from_url(url)
            stack.push_async_callback(client.aclose)
            for wid, (port, _) in fakes.items():  # what anyone with Redis access can write
                info = WorkerInfo(worker_id=wid, role="both", address=f"127.0.0.1:{port}", model="m", page_size=16,
                                  instance_nonce=f"forged-{wid}")
                await client.hset(keys.worker(wid), mapping=info.to_hash())
                await client.publish(keys.events_channel, json.dumps({"event": "join", "worker_id": wid}))
            router = RouterServer(RouterConfig(host="127.0.0.1", port=0, metrics_port=0, model="m",
                                               registry=registry(url), tls=tls(pki["router"])))
            await router.start()
            stack.push_async_callback(router.stop)
            assert router.watcher.trust is not None
            await asyncio.sleep(1.0)  # several scans, probes and a retry of each forged entry
            picks = {await call(f"127.0.0.1:{router.port}", server_name("router"), tls(pki["gateway"]))
                     for _ in range(12)}
            in_registry = {w.worker_id for w in router.watcher._workers.values()}
            return picks, in_registry, {wid: asked for wid, (_, asked) in fakes.items()}, real_asked
    picks, in_registry, fake_asked, real_asked = asyncio.run(run())
    assert in_registry == {"w", "decode-9", "decode-8", "decode-7"}  # read, and not trusted
    assert picks == {"ok: w"}
    assert fake_asked == {"decode-9": [], "decode-8": [], "decode-7": []}  # not one call got through
    assert real_asked and set(real_asked) == {"/grpc.health.v1.Health/Check"}  # the router's probe


def test_a_prefill_worker_still_being_asked_who_it_is_is_waited_for_not_prefilled_around(pki, redis_server):
    """A stack coming up: decode-0 is trusted, prefill-0 has just joined and its trust probe is
    slow to be answered. A Route meanwhile waits for the probe and pairs the two, rather than
    have decode-0 prefill the prompt alone as when no prefill worker is live (what the first
    requests after `duet up`'s banner got on a slow machine)."""
    url = redis_server.url

    async def run():
        async with contextlib.AsyncExitStack() as stack:
            ports = {}
            for wid, delay in (("decode-0", 0.0), ("prefill-0", 1.0)):
                ports[wid], _ = await stack.enter_async_context(stand_in_worker(tls(pki[wid]), delay))
            decode = WorkerPublisher(WorkerInfo(worker_id="decode-0", role="decode", address=f"127.0.0.1:{ports['decode-0']}",
                                                model="m", page_size=16), registry(url))
            await decode.start()
            stack.push_async_callback(decode.stop)
            router = RouterServer(RouterConfig(host="127.0.0.1", port=0, metrics_port=0, model="m",
                                               registry=registry(url), tls=tls(pki["router"])))
            await router.start()
            stack.push_async_callback(router.stop)
            assert await router.watcher.wait_for(lambda w: [x.worker_id for x in w.workers()] == ["decode-0"], 10)
            prefill = WorkerPublisher(WorkerInfo(worker_id="prefill-0", role="prefill",
                                                 address=f"127.0.0.1:{ports['prefill-0']}", model="m", page_size=16),
                                      registry(url))
            await prefill.start()
            stack.push_async_callback(prefill.stop)
            read = await router.watcher.wait_for(lambda w: "prefill-0" in w._workers and w.trust.pending, 10)
            channel = tls(pki["gateway"]).aio_channel(f"127.0.0.1:{router.port}", server_name("router"), LOCAL)
            async with channel:
                reply = await duet_pb2_grpc.RouterStub(channel).Route(duet_pb2.RouteRequest(prompt_tokens=5), timeout=10)
            return read, reply
    read, reply = asyncio.run(run())
    assert read, "the router never read prefill-0's entry while its probe was under way"
    assert (reply.prefill.worker_id, reply.decode.worker_id, reply.local_prefill) == ("prefill-0", "decode-0", False), \
        reply.reason


def test_a_switchable_worker_is_trusted_in_every_role_it_switches_to_and_a_prefill_certificate_never_as_decode(
        pki, redis_server):
    """A `worker` certificate (a switchable worker: shared/security/identity.py) answers the
    router's probe as a prefill and as a decode worker; its role switches reach the router by
    the registry's `role` event (the router's scans are 30 s apart here), and one between decode
    and `both` keeps what was proven (no new probe). A genuine prefill certificate behind an
    entry that advertises decode is never trusted."""
    url = redis_server.url
    slow_scans = RegistryConfig(redis_url=url, ttl_s=60.0, heartbeat_interval_s=30.0, scan_interval_s=30.0)

    async def run():
        async with contextlib.AsyncExitStack() as stack:
            port, asked = await stack.enter_async_context(stand_in_worker(tls(pki["worker-3"])))
            fake_port, fake_asked = await stack.enter_async_context(stand_in_worker(tls(pki["prefill-1"])))
            switching = WorkerPublisher(WorkerInfo(worker_id="worker-3", role="prefill", address=f"127.0.0.1:{port}",
                                                   model="m", page_size=16, switchable=True), slow_scans)
            lying = WorkerPublisher(WorkerInfo(worker_id="prefill-1", role="decode", address=f"127.0.0.1:{fake_port}",
                                               model="m", page_size=16), slow_scans)
            for pub in (switching, lying):
                await pub.start()
                stack.push_async_callback(pub.stop)
            router = RouterServer(RouterConfig(host="127.0.0.1", port=0, metrics_port=0, model="m",
                                               registry=slow_scans, tls=tls(pki["router"])))
            await router.start()
            stack.push_async_callback(router.stop)
            seen = []
            for role in ("prefill", "decode", "both"):
                if role != "prefill":
                    await switching.announce_role(role)
                # the first trust may need a second probe on a loaded machine, and a retry waits for
                # the next scan (30 s here); each switch after it must land by its role event alone
                ok = await router.watcher.wait_for(
                    lambda w: [x.role for x in w.workers()] == [role] and not w.trust.pending,
                    40 if role == "prefill" else 5)
                seen.append((role, ok, len(asked)))
            return seen, router.watcher.get("prefill-1"), fake_asked
    seen, lying_entry, fake_asked = asyncio.run(run())
    assert [(role, ok) for role, ok, _ in seen] == [("prefill", True), ("decode", True), ("both", True)]
    probes = [n for _, _, n in seen]
    assert probes[1] == probes[0] + 1 and probes[2] == probes[1]  # decode -> both: what was proven stands
    assert lying_entry is None and fake_asked == []


def test_config_flags_env_and_bad_files(pki, tmp_path):
    s = pki["router"]
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
    # each process checks at start that its certificate is its own
    tls(pki["router"]).check_identity("router")
    tls(pki["decode-0"]).check_identity("decode", "decode-0")
    tls(pki["decode-pool"]).check_identity("decode", "duet-decode-7c9f8-x2kq4")  # role-wide: any pod
    GrpcTlsConfig().check_identity("gateway")  # plaintext: nothing to check
    for files, role, worker_id, why in ((pki["decode-0"], "decode", "decode-1", "is decode decode-0's, not decode decode-1's"),
                                        (pki["decode-0"], "prefill", "decode-0", "is decode decode-0's"),
                                        (pki["router"], "gateway", "", "is router's, not gateway's"),
                                        (pki["no-role"], "gateway", "", "names no Duet role")):
        with pytest.raises(ValueError, match=why):
            tls(files).check_identity(role, worker_id)


def test_every_rpc_of_the_contract_names_who_may_call_it():
    """A method missing from the caller table is refused to everyone under mutual TLS (`duet up`'s
    default): the leases' RenewLease once was, so every reservation lapsed 10 s after its grant."""
    from shared.security.caller_guard import METHOD_ROLES

    methods = {f"/{service.full_name}/{m.name}" for service in duet_pb2.DESCRIPTOR.services_by_name.values()
               for m in service.methods}
    assert methods, "duet.proto names no service"
    unnamed = sorted(m for m in methods if not METHOD_ROLES.get(m))
    assert not unnamed, f"no role may call {unnamed} (shared/security/caller_guard.py)"
