"""Looking at the running pods the way one would on a cluster: a connection attempt from a
given pod, a Prometheus scrape from the monitoring namespace, the registry read by
`kubectl exec` into the Redis pod."""
from __future__ import annotations

import errno
import socket
import urllib.request

from tests.helpers.k8s_sim import netns


def connect(from_ns: str, host: str, port: int, timeout: float = 2.0) -> str:
    """'open', 'refused' (nothing listens, or a rejected Service port) or 'timeout' (dropped,
    as a NetworkPolicy drops)."""
    with netns.entered(from_ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        return "open"
    except socket.timeout:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return "unreachable" if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH) else repr(exc)
    finally:
        s.close()


def http_get(from_ns: str, url: str, timeout: float = 5.0) -> str:
    with netns.entered(from_ns):
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()


def scrape(from_ns: str, host: str, port: int):
    from tests.helpers.stack import Metrics
    return Metrics.parse(http_get(from_ns, f"http://{host}:{port}/metrics"))


def registry_workers(redis_pod, prefix: str = "duet") -> dict[str, dict[str, str]]:
    """Worker id -> registry hash, read inside the Redis pod (as `kubectl exec`) with the
    password its container has."""
    import redis
    with netns.entered(redis_pod.netns):
        r = redis.Redis(host="127.0.0.1", port=redis_pod.named_port("redis"), socket_timeout=3,
                        password=redis_pod.container.env["REDIS_PASSWORD"], decode_responses=True)
        try:
            out = {}
            for key in r.scan_iter(f"{prefix}:worker:*"):
                rest = key[len(f"{prefix}:worker:"):]
                if ":" not in rest:  # not the :nixl / :pages side keys
                    fields = r.hgetall(key)
                    if fields:
                        out[rest] = fields
            return out
        finally:
            r.close()
