"""`duet up`'s port check against a port the way a just-stopped stack leaves it: the old
listener gone, its closed connections in TIME_WAIT on the server side; and the ports it
hands its children (services/launcher/ports.py, port_claims.py)."""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from services.launcher.main import main as duet_up
from services.launcher.ports import port_taken
from tests.helpers.gateway_support import UvicornThread

ROOT = Path(__file__).resolve().parents[2]


def _time_wait_port(connections: int = 3) -> int:
    """A port whose only sockets are server-side connections in TIME_WAIT: the server
    closes each accepted connection first (the side that closes first waits), then the
    listener goes away, as when the gateway stops after serving clients."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    for _ in range(connections):
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn, _ = listener.accept()
        conn.sendall(b"bye")
        conn.close()  # server side: FIN first
        assert client.recv(16) == b"bye" and client.recv(16) == b""  # EOF seen: the server's FIN arrived
        client.close()  # client's FIN: the server side enters TIME_WAIT
    listener.close()
    return port


def _tcp_states(port: int) -> list[str]:
    """States of the IPv4 sockets whose local port is `port`, from /proc/net/tcp (06 = TIME_WAIT)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return [row[3] for row in rows if int(row[1].split(":")[1], 16) == port]


def test_time_wait_connections_do_not_make_the_port_taken():
    port = _time_wait_port()
    assert "06" in _tcp_states(port), "no server-side TIME_WAIT socket on the port: nothing reproduced"
    # what the old check did (a bind without SO_REUSEADDR) fails here...
    with socket.socket() as plain, pytest.raises(OSError) as info:
        plain.bind(("127.0.0.1", port))
    assert info.value.errno == errno.EADDRINUSE
    # ...but the servers would bind, and so says the check
    assert not port_taken("127.0.0.1", port)
    app = FastAPI()
    app.get("/")(lambda: {"ok": True})
    with UvicornThread(app, port=port) as server:  # a real uvicorn on that very port
        assert httpx.get(server.base_url + "/").json() == {"ok": True}
        assert port_taken("127.0.0.1", port)  # a live listener still counts


def test_duet_up_refuses_a_port_a_server_listens_on(capsys):
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # even one that allows reuse
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert duet_up(["--host", "127.0.0.1", "--port", str(port)]) == 2
    assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err


def test_free_port_is_outside_the_outgoing_connection_range_and_bindable():
    """`duet up` hands its children ports to bind later; one from the range the OS gives
    outgoing connections could be some client's local port by then (a router failed so)."""
    from services.launcher.ports import _ephemeral_ports, free_port

    lo, hi = _ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(not lo <= p <= hi for p in ports), (sorted(ports), lo, hi)
    assert len(ports) > 1  # random picks, not one fixed port
    for p in list(ports)[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_claimed_port_is_not_handed_out_again_until_the_claim_lapses(tmp_path):
    from services.launcher.port_claims import CLAIM_S, claim

    folder = tmp_path / "claims"
    assert claim(40001, folder, now=1000.0)
    assert not claim(40001, folder, now=1000.0 + CLAIM_S / 2)  # another picker's, a moment ago
    assert claim(40002, folder, now=1000.0)
    assert claim(40001, folder, now=1000.0 + CLAIM_S + 1)  # lapsed: the port may be bound or free
    assert not claim(40001, folder, now=1000.0 + CLAIM_S + 2)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert claim(40003, blocked / "claims")  # nowhere to write a claim: every port may go


def test_two_processes_picking_at_once_never_hand_out_the_same_port(tmp_path):
    """Ports are bound seconds after they are picked (a child's imports): two processes picking
    then (two test workers, two launchers) must not pick alike. 2 x 300 picks among ~27k ports
    would share about three without the claims."""
    script = ("import sys\nfrom services.launcher.ports import free_port\n"
              "print(' '.join(str(free_port()) for _ in range(300)))\n")
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    picks = [set(map(int, p.communicate(timeout=120)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(picks[0]) == len(picks[1]) == 300
    assert not picks[0] & picks[1], sorted(picks[0] & picks[1])
