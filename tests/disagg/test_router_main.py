"""`duet router` as a process: flags and env, serving Route, clean exit on SIGTERM."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from protos import duet_pb2, duet_pb2_grpc
from services.router.config import RouterConfig
from shared.registry.config import RegistryConfig
from shared.registry.publisher import WorkerPublisher
from shared.registry.worker_info import WorkerInfo
from tests.helpers.redis_server import free_port, redis_server  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]


def test_config_from_flags_and_env():
    env = {"DUET_REDIS_URL": "redis://r:1/0", "DUET_ROUTER_PORT": "6000", "DUET_SERVED_MODEL_NAME": "qwen"}
    config = RouterConfig.from_argv(["--metrics-port", "0"], env)
    assert (config.port, config.metrics_port, config.model, config.registry.redis_url) == (6000, 0, "qwen", "redis://r:1/0")
    config = RouterConfig.from_argv(["--port", "7000", "--redis-url", "redis://x:2/0", "--model", "m"], env)
    assert (config.port, config.model, config.registry.redis_url) == (7000, "m", "redis://x:2/0")


def test_router_process_serves_and_exits_on_sigterm(redis_server):
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "DUET_REDIS_URL": redis_server.url}
    proc = subprocess.Popen([sys.executable, "-m", "services.router.main", "--host", "127.0.0.1",
                             "--port", str(port), "--metrics-port", str(metrics_port), "--model", "m",
                             "--registry-ttl", "2", "--registry-heartbeat", "0.5"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    registry = RegistryConfig(redis_url=redis_server.url, ttl_s=2.0, heartbeat_interval_s=0.5)

    async def scenario():
        pub = WorkerPublisher(WorkerInfo(worker_id="b", role="both", address="b:1", model="m", page_size=16),
                              registry)
        await pub.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = duet_pb2_grpc.RouterStub(channel)
            deadline = time.monotonic() + 60
            while True:
                try:
                    reply = await stub.Route(duet_pb2.RouteRequest(prompt_tokens=5), timeout=2)
                    break
                except grpc.aio.AioRpcError as exc:
                    assert proc.poll() is None, proc.stdout.read().decode()
                    assert time.monotonic() < deadline, f"router never served: {exc.details()}"
                    await asyncio.sleep(0.2)
        await pub.stop()
        return reply

    try:
        reply = asyncio.run(scenario())
        assert reply.colocated and reply.decode.worker_id == "b"
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert 'duet_router_decisions_total{kind="colocated",model="m",reason="only_colocated"}' in body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_router_whose_metrics_port_is_taken_exits_saying_so(redis_server):
    """A port taken between `duet up` picking it and the router binding it (CI's parallel
    stacks): the router exits with status 1 and names the port, so its supervisor restarts it.
    It used to start gRPC first, then fail on the metrics port and hang while asyncio cancelled
    the gRPC server's tasks: alive, listening, answering nothing."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics_port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO), "DUET_REDIS_URL": redis_server.url}
        proc = subprocess.Popen([sys.executable, "-m", "services.router.main", "--host", "127.0.0.1",
                                 "--port", str(free_port()), "--metrics-port", str(metrics_port)],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"the router hung: {proc.communicate()[0].decode()[-2000:]}") from None
    assert proc.returncode == 1, out.decode()
    assert f"metrics to 127.0.0.1:{metrics_port}" in out.decode()
