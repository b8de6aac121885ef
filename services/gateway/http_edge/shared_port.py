"""The HTTP port shared by several gateway processes (`duet up --gateway-processes N`): each
binds it with SO_REUSEPORT, and the kernel spreads new connections over the processes that
listen on it. One process serves a few thousand streamed tokens a second of Python (detokenizing,
SSE framing: docs/performance/cpu.md); more processes lift that ceiling without a proxy in
front. A process joins the spread only once it listens (after its start-up), and one that dies
leaves it once its socket is closed, so the others take every new connection until it is back;
the connections the dead one held, or had queued unaccepted, are reset with it."""
from __future__ import annotations

import socket


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, for uvicorn to listen on."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("this platform has no SO_REUSEPORT: run one gateway process (--gateway-processes 1)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock
