"""Is a port free for the gateway? Asked the way the servers bind it.

uvicorn (asyncio's create_server) and gRPC set SO_REUSEADDR before binding, so a port whose
only sockets are old connections in TIME_WAIT (the stack just stopped, clients had
connected) is free for them. A bind without the option would call it taken for up to a
minute after a restart. A socket still listening on it makes the bind fail either way."""
from __future__ import annotations

import os
import socket
import sys

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


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (the OS's pick); each child keeps its port across restarts."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
