"""Is a port free for the gateway? Asked the way the servers bind it.

uvicorn (asyncio's create_server) and gRPC set SO_REUSEADDR before binding, so a port whose
only sockets are old connections in TIME_WAIT (the stack just stopped, clients had
connected) is free for them. A bind without the option would call it taken for up to a
minute after a restart. A socket still listening on it makes the bind fail either way."""
from __future__ import annotations

import os
import random
import socket
import sys

from services.launcher.port_claims import claim

# asyncio's create_server default for reuse_address (Windows' SO_REUSEADDR means something else)
REUSE_ADDRESS = os.name == "posix" and sys.platform != "cygwin"


def port_taken(host: str, port: int) -> bool:
    """True when a server could not bind host:port now (another one listens there)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # an unknown host is the server's error to report, with its own message
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        if REUSE_ADDRESS:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError:
            return True
    return False


def _ephemeral_ports() -> tuple[int, int]:
    """The range the OS takes local ports of outgoing connections from (Linux's default if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a child to bind later; each child keeps its port across restarts.
    Picked outside the range the OS gives outgoing connections: a port from there (what binding
    port 0 returns) can become some client's local port before the child binds it, and a test
    run opens thousands of connections (a router once failed that way and hung)."""
    lo, hi = _ephemeral_ports()
    spans = [(p, q) for p, q in ((10000, lo - 1), (hi + 1, 65535)) if q - p >= 1000]
    pick = random.SystemRandom()
    for _ in range(64 if spans else 0):
        first, last = pick.choices(spans, weights=[q - p for p, q in spans])[0]  # every port alike
        port = pick.randint(first, last)
        if not port_taken(host, port) and claim(port):  # nor handed out by another process just now
            return port
    with socket.socket() as s:  # no room outside the range: the OS's pick
        s.bind((host, 0))
        return s.getsockname()[1]
