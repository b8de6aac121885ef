"""Kubelet probes: httpGet, tcpSocket and grpc from the node (the calling thread must be in
the node's network namespace), exec inside the container. Each returns (ok, detail)."""
from __future__ import annotations

import http.client
import socket
import subprocess
import sys

HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def _port(spec: dict, pod) -> int:
    port = spec["port"]
    return port if isinstance(port, int) else int(port) if str(port).isdigit() else pod.named_port(str(port))


def http_get(spec: dict, pod, timeout: float) -> tuple[bool, str]:
    host = spec.get("host") or pod.ip
    if spec.get("scheme", "HTTP").upper() == "HTTPS":
        import ssl
        conn = http.client.HTTPSConnection(host, _port(spec, pod), timeout=timeout,
                                           context=ssl._create_unverified_context())  # the kubelet skips verification
    else:
        conn = http.client.HTTPConnection(host, _port(spec, pod), timeout=timeout)
    try:
        headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
        headers.setdefault("User-Agent", "kube-probe/1.32")
        conn.request("GET", spec.get("path", "/"), headers=headers)
        status = conn.getresponse().status
        return 200 <= status < 400, f"HTTP {status}"
    except OSError as exc:
        return False, repr(exc)
    finally:
        conn.close()


def tcp_socket(spec: dict, pod, timeout: float) -> tuple[bool, str]:
    try:
        with socket.create_connection((spec.get("host") or pod.ip, _port(spec, pod)), timeout=timeout):
            return True, "connected"
    except OSError as exc:
        return False, repr(exc)


def grpc_health(spec: dict, pod, timeout: float, node_ns: str) -> tuple[bool, str]:
    """grpc.health.v1 Check; in a child process in the node namespace (gRPC's own threads
    would not inherit this thread's namespace)."""
    code = ("import grpc,sys\n"
            "svc=sys.argv[2].encode()\n"
            "req=(b'\\x0a'+bytes([len(svc)])+svc) if svc else b''\n"
            "ch=grpc.insecure_channel(sys.argv[1])\n"
            f"rsp=ch.unary_unary('{HEALTH_CHECK}',request_serializer=lambda b:b,response_deserializer=lambda b:b)"
            "(req,timeout=float(sys.argv[3]))\n"
            "sys.exit(0 if rsp==b'\\x08\\x01' else 1)\n")
    out = subprocess.run(["ip", "netns", "exec", node_ns, sys.executable, "-c", code, f"{pod.ip}:{_port(spec, pod)}",
                          spec.get("service", ""), str(timeout)], capture_output=True, text=True, timeout=timeout + 30)
    return out.returncode == 0, out.stderr.strip()[-300:] or "SERVING"


def run_probe(spec: dict, pod, node_ns: str) -> tuple[bool, str]:
    timeout = float(spec.get("timeoutSeconds", 1))
    if "httpGet" in spec:
        return http_get(spec["httpGet"], pod, timeout)
    if "tcpSocket" in spec:
        return tcp_socket(spec["tcpSocket"], pod, timeout)
    if "grpc" in spec:
        return grpc_health(spec["grpc"], pod, timeout, node_ns)
    if "exec" in spec:
        out = pod.container.exec(list(spec["exec"]["command"]), timeout)
        return out.returncode == 0, f"exit {out.returncode} {out.stderr.strip()[-200:]}"
    raise NotImplementedError(f"probe {sorted(spec)}")
