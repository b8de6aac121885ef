"""The Kubernetes actuator: the replicas of the prefill and decode pools (Deployments), read and
set through their `scale` subresource with the pod's service account (in-cluster: the API
server from KUBERNETES_SERVICE_HOST/PORT, the token and CA the kubelet mounts). Plain HTTPS:
the RBAC Role in k8s/components/planner allows exactly `get` and `patch` on those two
Deployments' scale, nothing else."""
from __future__ import annotations

import asyncio
import json
import os
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 10.0


class KubeError(RuntimeError):
    pass


@dataclass(frozen=True)
class KubeApi:
    base_url: str          # https://host:port
    token_file: Path       # read at every call: projected tokens rotate
    ca_file: Path | None

    @classmethod
    def in_cluster(cls, account: Path = SERVICE_ACCOUNT) -> "KubeApi":
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (account / "token").exists():
            raise KubeError("not in a Kubernetes pod with a service account token (KUBERNETES_SERVICE_HOST, "
                            f"{account / 'token'}): --k8s-scale needs one")
        host = f"[{host}]" if ":" in host else host
        ca = account / "ca.crt"
        return cls(f"https://{host}:{port}", account / "token", ca if ca.exists() else None)

    def _call(self, method: str, path: str, body: dict | None = None, content_type: str = "application/json") -> dict:
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        headers = {"Authorization": f"Bearer {self.token_file.read_text().strip()}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as r:  # noqa: S310
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise KubeError(f"{method} {path}: HTTP {exc.code} {exc.read()[:300]!r}") from None
        except OSError as exc:
            raise KubeError(f"{method} {path}: {exc}") from None

    @staticmethod
    def scale_path(namespace: str, deployment: str) -> str:
        return f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}/scale"

    async def replicas(self, namespace: str, deployment: str) -> int:
        scale = await asyncio.to_thread(self._call, "GET", self.scale_path(namespace, deployment))
        return int(scale.get("spec", {}).get("replicas", 0))

    async def set_replicas(self, namespace: str, deployment: str, replicas: int) -> None:
        await asyncio.to_thread(self._call, "PATCH", self.scale_path(namespace, deployment),
                                {"spec": {"replicas": replicas}}, "application/merge-patch+json")


def namespace_of(configured: str, account: Path = SERVICE_ACCOUNT) -> str:
    if configured:
        return configured
    try:
        return (account / "namespace").read_text().strip()
    except OSError:
        raise KubeError("no --k8s-namespace and no service account namespace file") from None
