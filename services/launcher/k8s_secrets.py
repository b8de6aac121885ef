"""`duet k8s-secrets`: the Secrets the Kubernetes manifests mount and never render, as YAML
for `kubectl apply -f -`: a random Redis password (duet-redis-auth), the gateways' prefix-cache
namespace key (duet-cache-namespace-key, key `key`: every replica must read the same) and, from a throwaway CA,
one certificate per role in duet-grpc-<role> (cert-manager's keys tls.crt, tls.key, ca.crt;
k8s/components/grpc-tls says what each names). The CA's key is never written: to rotate,
run it again, apply, and restart every Duet pod (`kubectl -n duet rollout restart deploy`):
a pod with the old CA cannot talk to one with the new."""
from __future__ import annotations

import argparse
import base64
import datetime as dt
import secrets
import sys
from collections.abc import Sequence

import yaml

from services.launcher.throwaway_pki import ThrowawayCA
from shared.security.identity import Identity

# one Deployment each; `worker`: the switchable workers of both pools (components/planner),
# `planner`: the only caller of their SetRole
K8S_ROLES = ("gateway", "router", "prefill", "decode", "worker", "planner")


def _secret(name: str, namespace: str, data: dict[str, bytes], kind: str = "Opaque") -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
            "type": kind, "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


def secret_objects(namespace: str = "duet", days: int = 365, *, grpc: bool = True, redis: bool = True,
                   cache_key: bool = True) -> list[dict]:
    out = []
    if redis:  # hex: it is embedded in redis://:<password>@host URLs
        out.append(_secret("duet-redis-auth", namespace, {"password": secrets.token_hex(24).encode()}))
    if cache_key:  # a new key empties every tenant's cached prefixes (their namespaces change)
        out.append(_secret("duet-cache-namespace-key", namespace, {"key": secrets.token_hex(32).encode()}))
    if grpc:
        ca = ThrowawayCA("duet-k8s", dt.timedelta(days=days))
        for role in K8S_ROLES:
            issued = ca.issue(Identity(role))
            out.append(_secret(f"duet-grpc-{role}", namespace,
                               {"tls.crt": issued.cert, "tls.key": issued.key, "ca.crt": ca.ca_pem},
                               kind="kubernetes.io/tls"))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet k8s-secrets", description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", default="duet", help="namespace of the Secrets (default: duet)")
    p.add_argument("--days", type=int, default=365, help="how long the certificates are valid (default: 365)")
    p.add_argument("--skip-grpc", action="store_true",
                   help="no certificates (components/cert-manager issues them)")
    p.add_argument("--skip-redis", action="store_true", help="no Redis password")
    p.add_argument("--skip-cache-key", action="store_true",
                   help="no prefix-cache namespace key (keep the one applied: a new one drops every cached prefix)")
    a = p.parse_args(argv)
    if a.days < 1:
        p.error("--days must be >= 1")
    objects = secret_objects(a.namespace, a.days, grpc=not a.skip_grpc, redis=not a.skip_redis,
                             cache_key=not a.skip_cache_key)
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0
