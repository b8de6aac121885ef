"""The registry over Redis with a password and TLS (rediss://): a real redis-server started
with --requirepass and --tls-port (certificates made here); the worker's publisher, the
router's watcher and the sync client reach it only with the right password and CA."""
from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import pytest
import redis

from shared.registry.config import RegistryConfig
from shared.registry.connection import RedisConnection
from shared.registry.peers import connect_sync
from shared.registry.publisher import WorkerPublisher
from shared.registry.watcher import WorkerWatcher
from shared.registry.worker_info import WorkerInfo
from shared.security.secret_files import redact_url
from shared.settings.flags import add_flags, from_args
from tests.helpers.redis_server import REDIS_SERVER_BIN, free_port
from tests.helpers.tls_certs import TestCA

PASSWORD = "s3cret-registry-password"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """redis-server serving TLS only (no plaintext port), with a password, client certs optional."""
    if shutil.which(REDIS_SERVER_BIN) is None and not REDIS_SERVER_BIN.startswith("/"):
        pytest.fail("redis-server is needed")
    root = tmp_path_factory.mktemp("redis-tls")
    ca = TestCA(root / "pki")
    server = ca.issue("redis", "duet-redis")
    port = free_port()
    conf = root / "redis.conf"  # the password in a file, not on redis-server's command line
    conf.write_text(f"port 0\ntls-port {port}\nbind 127.0.0.1\nsave \"\"\nappendonly no\n"
                    f"dir {root}\ntls-cert-file {server.cert}\ntls-key-file {server.key}\n"
                    f"tls-ca-cert-file {server.ca}\ntls-auth-clients optional\nrequirepass {PASSWORD}\n")
    proc = subprocess.Popen([REDIS_SERVER_BIN, str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        assert proc.poll() is None, f"redis-server (TLS build?) exited: {proc.stdout.read().decode()}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "redis-server did not open its TLS port"
            time.sleep(0.05)
    yield {"url": f"rediss://127.0.0.1:{port}/0", "ca": str(server.ca), "port": port,
           "stranger_ca": str(TestCA(root / "other", name="other-ca").ca_file)}
    proc.terminate()
    proc.wait(10)


def config(url: str, **connection) -> RegistryConfig:
    return RegistryConfig(redis_url=url, ttl_s=2.0, heartbeat_interval_s=0.3, scan_interval_s=0.2,
                          socket_timeout_s=2.0, connection=RedisConnection(**connection))


def ping(cfg: RegistryConfig) -> str:
    try:
        with connect_sync(cfg) as client:
            return "ok" if client.ping() else "no"
    except redis.AuthenticationError:
        return "auth"
    except redis.ConnectionError as exc:
        return "tls" if "SSL" in str(exc) or "certificate" in str(exc).lower() else f"conn: {exc}"
    except redis.ResponseError as exc:
        return "auth" if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc) else f"resp: {exc}"


def test_only_the_right_password_and_ca_reach_the_registry(tls_redis):
    url, ca = tls_redis["url"], tls_redis["ca"]
    assert ping(config(url, password=PASSWORD, tls_ca_file=ca)) == "ok"
    assert ping(config(url, password="wrong", tls_ca_file=ca)) == "auth"
    assert ping(config(url, tls_ca_file=ca)) == "auth"
    assert ping(config(url, password=PASSWORD, tls_ca_file=tls_redis["stranger_ca"])) == "tls"
    assert ping(config(url, password=PASSWORD)) == "tls"  # the system roots do not know our CA
    assert ping(config(f"redis://127.0.0.1:{tls_redis['port']}/0", password=PASSWORD)).startswith("conn")
    # the password in the URL (as the manifests build it) works as well
    assert ping(config(f"rediss://:{PASSWORD}@127.0.0.1:{tls_redis['port']}/0", tls_ca_file=ca)) == "ok"


def test_publisher_and_watcher_over_tls_with_a_password(tls_redis):
    cfg = config(tls_redis["url"], password=PASSWORD, tls_ca_file=tls_redis["ca"])

    async def scenario():
        pub = WorkerPublisher(WorkerInfo(worker_id="tls-w", role="both", address="a:1", model="m", page_size=16), cfg)
        watcher = WorkerWatcher(cfg, model="m")
        await pub.start()
        await watcher.start()
        try:
            for _ in range(100):
                if watcher.workers():
                    break
                await asyncio.sleep(0.05)
            return [w.worker_id for w in watcher.workers()], watcher.redis_ok
        finally:
            await watcher.stop()
            await pub.stop()

    seen, ok = asyncio.run(scenario())
    assert seen == ["tls-w"] and ok


def test_flags_env_files_and_redaction(tmp_path):
    import argparse

    pw = tmp_path / "password"
    pw.write_text(PASSWORD + "\n")
    p = argparse.ArgumentParser()
    add_flags(p, RegistryConfig, {"DUET_REDIS_PASSWORD_FILE": str(pw), "DUET_REDIS_TLS_CA_FILE": "/ca.crt",
                                  "DUET_REDIS_URL": "rediss://r:6380/0"})
    cfg = from_args(RegistryConfig, p.parse_args([]))
    assert cfg.connection.password == PASSWORD and PASSWORD not in repr(cfg)
    kwargs = cfg.client_kwargs()
    assert kwargs["password"] == PASSWORD and kwargs["ssl_ca_certs"] == "/ca.crt"
    assert kwargs["ssl_cert_reqs"] == "required"
    p = argparse.ArgumentParser()
    add_flags(p, RegistryConfig, {"DUET_REDIS_PASSWORD": "from-env"})
    assert from_args(RegistryConfig, p.parse_args([])).connection.password == "from-env"
    with pytest.raises(ValueError, match="not rediss"):
        RegistryConfig(redis_url="redis://r:1/0", connection=RedisConnection(tls_ca_file="/ca.crt")).client_kwargs()
    assert redact_url("redis://:hunter2@duet-redis:6379/0") == "redis://:***@duet-redis:6379/0"
    assert redact_url("rediss://user:pw@[::1]:6380/0") == "rediss://user:***@[::1]:6380/0"
    assert redact_url("redis://r:1/0") == "redis://r:1/0"
