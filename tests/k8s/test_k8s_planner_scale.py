"""The planner's Kubernetes actuator (services/planner/kube_scale.py) against a stand-in API
server over HTTPS: the pools' replicas read and set through the Deployments' `scale`
subresource with the service account's bearer token (read again at every call: projected
tokens rotate), a JSON merge patch, and what the RBAC Role of k8s/components/planner does not
allow (any other Deployment) refused with the API server's status. Then the planner's own step
(services/planner/main.py, Planner.scale): one pod more in the pool the prediction names, and
nothing while the pools do not yet hold what they were set to."""
from __future__ import annotations

import asyncio
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry import trace

from services.planner.config import PlannerConfig
from services.planner.decide import Decision
from services.planner.kube_scale import KubeApi, KubeError
from services.planner.main import Planner
from services.planner.predict import Corrections, Fleet, Split
from services.planner.report import PlannerMetrics
from tests.helpers.planner_fleet import long_prompts, worker
from tests.helpers.tls_certs import TestCA

ALLOWED = {"duet-prefill", "duet-decode"}  # what the Role grants: get and patch on their scale


class StandInApiServer:
    """The scale subresource of two Deployments in namespace duet, behind a bearer token."""

    def __init__(self, cert, key, token: str):
        self.replicas = {"duet-prefill": 1, "duet-decode": 1}
        self.token = token
        self.calls: list[tuple[str, str, str, dict | None]] = []  # method, path, content type, body
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                server.calls.append((method, self.path, self.headers.get("Content-Type", ""), body))
                if self.headers.get("Authorization") != f"Bearer {server.token}":
                    return self._answer(401, {"kind": "Status", "reason": "Unauthorized"})
                parts = self.path.strip("/").split("/")
                # apis/apps/v1/namespaces/<ns>/deployments/<name>/scale
                if len(parts) != 8 or parts[:4] != ["apis", "apps", "v1", "namespaces"] or parts[7] != "scale":
                    return self._answer(404, {"kind": "Status", "reason": "NotFound"})
                namespace, name = parts[4], parts[6]
                if namespace != "duet" or name not in ALLOWED:
                    return self._answer(403, {"kind": "Status", "reason": "Forbidden"})
                if method == "PATCH":
                    if self.headers.get("Content-Type") != "application/merge-patch+json":
                        return self._answer(415, {"kind": "Status", "reason": "UnsupportedMediaType"})
                    server.replicas[name] = int(body["spec"]["replicas"])
                self._answer(200, {"kind": "Scale", "metadata": {"name": name, "namespace": namespace},
                                   "spec": {"replicas": server.replicas[name]}})

            def do_GET(self):
                self._handle("GET")

            def do_PATCH(self):
                self._handle("PATCH")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert), str(key))
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    ca = TestCA(tmp_path / "pki")
    files = ca.issue("apiserver", "kubernetes")
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("token-1\n")
    (account / "ca.crt").write_bytes(files.ca.read_bytes())
    (account / "namespace").write_text("duet")
    server = StandInApiServer(files.cert, files.key, "token-1")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    try:
        yield server, account
    finally:
        server.close()


def test_replicas_are_read_and_patched_with_the_service_accounts_token(cluster):
    server, account = cluster
    api = KubeApi.in_cluster(account)

    async def run():
        assert await api.replicas("duet", "duet-prefill") == 1
        await api.set_replicas("duet", "duet-prefill", 3)
        assert await api.replicas("duet", "duet-prefill") == 3
        (account / "token").write_text("token-2\n")  # the kubelet rotated it
        server.token = "token-2"
        await api.set_replicas("duet", "duet-decode", 2)
        with pytest.raises(KubeError, match="HTTP 403"):
            await api.set_replicas("duet", "duet-gateway", 5)  # not the planner's to scale
        with pytest.raises(KubeError, match="HTTP 403"):
            await api.replicas("kube-system", "duet-prefill")
    asyncio.run(run())
    assert server.replicas == {"duet-prefill": 3, "duet-decode": 2}
    patches = [c for c in server.calls if c[0] == "PATCH" and c[1].endswith("/scale")]
    assert patches[0] == ("PATCH", "/apis/apps/v1/namespaces/duet/deployments/duet-prefill/scale",
                          "application/merge-patch+json", {"spec": {"replicas": 3}})


def test_outside_a_pod_scaling_is_refused_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeError, match="service account token"):
        KubeApi.in_cluster(tmp_path)


def test_the_planner_adds_one_pod_where_the_prediction_puts_it_once_the_pools_are_settled(cluster):
    server, account = cluster
    config = PlannerConfig.from_argv(["--k8s-scale", "--k8s-namespace", "duet", "--prefill-max-replicas", "3",
                                      "--planner-min-requests", "5"], env={})
    from prometheus_client import CollectorRegistry
    planner = Planner(config, trace.get_tracer("test"), PlannerMetrics(CollectorRegistry()),
                      KubeApi.in_cluster(account))
    workers = [worker("duet-prefill-7f9c-a1", "prefill"), worker("duet-decode-5d2b-b2", "decode")]
    fleet = Fleet.of(workers, 5.0, 0.0)
    load = long_prompts(1.2, 2.0)  # more long prompts than one prefill worker can take
    decision = Decision("keep", "best", Split(1, 1), Split(1, 1), load, {}, Corrections())

    async def run():
        with trace.get_tracer("test").start_as_current_span("planner.decide") as span:
            await planner.scale(workers, decision, fleet, span)
            assert server.replicas == {"duet-prefill": 2, "duet-decode": 1}
            # the new pod has not joined yet: no second step on top of the first
            await planner.scale(workers, decision, fleet, span)
            assert server.replicas == {"duet-prefill": 2, "duet-decode": 1}
            joined = workers + [worker("duet-prefill-7f9c-c3", "prefill")]
            assert not planner.decider.dwelt(planner.decider.changed_at + 1)  # the step restarted the dwell
            await planner.scale(joined, Decision("keep", "best", Split(2, 1), Split(2, 1), long_prompts(0.4, 1.0),
                                                 {}, Corrections()), Fleet.of(joined, 5.0, 0.0), span)
            assert server.replicas == {"duet-prefill": 2, "duet-decode": 1}  # within the targets now
    asyncio.run(run())
    assert planner.metrics.decisions.labels(action="scale", reason="slo")._value.get() == 1
    assert planner.metrics.pool_replicas.labels(pool="prefill")._value.get() == 2
