"""`duet up`'s supervision without a stack: the restart policy (backoff doubling up to a cap,
a long run forgives earlier deaths, giving up after the limit), the supervisor loop over
children that die (on a fake clock), the drain plan, and the throwaway certificates and Redis
password it makes by default (unless --insecure)."""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.launcher.banner import certificates_in, registry_url_in
from services.launcher.children import Child, describe_exit
from services.launcher.main import workers_not_ready
from services.launcher.config import UpConfig
from services.launcher.restart_policy import MAX_BACKOFF_S, RestartCounter, RestartPolicy
from services.launcher.security import SecretsDir, make_secure
from services.launcher.throwaway_pki import CertFiles
from services.launcher.shutdown import KILL_AFTER_S, DrainPlan, stop_children
from services.launcher.supervisor import Supervisor
from shared.security.identity import server_name


def test_backoff_doubles_up_to_the_cap_then_gives_up():
    counter = RestartCounter(RestartPolicy(limit=8, backoff_s=1.0, reset_after_s=60))
    delays = [counter.died(ran_s=2.0) for _ in range(8)]
    assert all(v.restart for v in delays)
    assert [v.delay_s for v in delays] == [1, 2, 4, 8, 16, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S]
    assert [v.attempt for v in delays] == list(range(1, 9))
    last = counter.died(ran_s=2.0)
    assert not last.restart and last.attempt == 9


def test_a_long_run_forgives_earlier_deaths():
    counter = RestartCounter(RestartPolicy(limit=2, backoff_s=0.5, reset_after_s=10))
    assert counter.died(1.0).delay_s == 0.5
    assert counter.died(1.0).delay_s == 1.0
    again = counter.died(10.0)  # ran long enough: a new row, from the first delay
    assert again.restart and again.delay_s == 0.5 and again.attempt == 1


def test_limit_zero_never_restarts():
    assert not RestartCounter(RestartPolicy(limit=0)).died(1000.0).restart


@dataclass
class FakeChild:
    """What the supervisor reads of a child; `code` is set to make it die."""

    name: str
    log_path: Path = Path("/nonexistent.log")
    code: int | None = None
    started_at: float = 0.0
    starts: list[float] = field(default_factory=list)
    clock: list[float] = field(default_factory=lambda: [0.0])
    pid: int = 1
    kind: str = "worker"

    @property
    def running(self) -> bool:
        return self.code is None

    @property
    def exit_code(self) -> int | None:
        return self.code

    def start(self) -> None:
        self.code = None
        self.started_at = self.clock[0]
        self.starts.append(self.clock[0])

    def tail(self, lines: int = 15) -> str:
        return "the last words"


def test_supervisor_restarts_with_backoff_and_names_the_child_it_gives_up_on():
    now = [0.0]
    worker, router = FakeChild("decode-0", clock=now), FakeChild("router", clock=now)
    said: list[str] = []
    sup = Supervisor([worker, router], RestartPolicy(limit=2, backoff_s=1.0, reset_after_s=30), said.append,
                     clock=lambda: now[0])
    assert sup.tick() is None and said == []

    now[0] = 5.0
    worker.code = -9
    assert sup.tick() is None
    assert said[-1].startswith("decode-0 exited with code -9 (SIGKILL) after 5.0s; restarting it in 1.0s "
                               "(restart 1 of at most 2 in a row)") and "the last words" in said[-1]
    now[0] = 5.5
    assert sup.tick() is None and worker.starts == []  # not before its delay
    now[0] = 6.0
    assert sup.tick() is None and worker.starts == [6.0] and said[-1] == "restarted decode-0 (pid 1)"

    now[0] = 7.0
    worker.code = 1
    sup.tick()
    assert "restarting it in 2.0s (restart 2 of at most 2" in said[-1]
    now[0] = 9.0
    sup.tick()
    assert worker.starts == [6.0, 9.0]
    now[0] = 10.0
    worker.code = 1
    assert sup.tick() is worker
    assert "giving up on it: it died 3 times in a row, each within 30s of its start (--restart-limit 2)" in said[-1]
    assert router.starts == [] and sup.restarts == 2


def test_once_the_stack_served_a_worker_that_keeps_dying_is_left_down_and_tried_again_while_others_serve():
    now = [0.0]
    w0, w1, router = FakeChild("decode-0", clock=now), FakeChild("decode-1", clock=now), \
        FakeChild("router", clock=now, kind="router")
    said: list[str] = []
    sup = Supervisor([w0, w1, router], RestartPolicy(limit=1, backoff_s=1.0, reset_after_s=30, retry_s=100),
                     said.append, clock=lambda: now[0])
    sup.serving = True

    def die(child, at):
        now[0] = at
        child.code = -9
        return sup.tick()
    assert die(w0, 5.0) is None and "restart 1 of at most 1" in said[-1]
    now[0] = 6.0
    sup.tick()
    assert w0.starts == [6.0]
    # past the limit: decode-1 still runs, so decode-0 is left down, not the stack stopped
    assert die(w0, 7.0) is None
    assert "leaving it down: it died 2 times in a row" in said[-1] and "trying it again in 100s" in said[-1]
    now[0] = 50.0
    assert sup.tick() is None and w0.starts == [6.0]  # not before the retry
    now[0] = 107.0
    assert sup.tick() is None and w0.starts == [6.0, 107.0]
    assert die(w0, 108.0) is None and "leaving it down" in said[-1]  # dies again: left down again
    # the last worker that keeps dying, with no other worker running, stops the stack as before
    w1.code = -9
    now[0] = 109.0
    sup.tick()  # restart 1 of decode-1
    now[0] = 111.0
    sup.tick()
    assert die(w1, 112.0) is w1 and "giving up on it" in said[-1]
    # and a non-worker is given up on whatever the workers do
    sup2 = Supervisor([FakeChild("router", clock=now, kind="router"), FakeChild("decode-0", clock=now)],
                      RestartPolicy(limit=0), said.append, clock=lambda: now[0])
    sup2.serving = True
    sup2.children[0].code = 1
    assert sup2.tick() is sup2.children[0]
    # restarts off (--restart-limit 0) means never, for a worker too
    off = Supervisor([FakeChild("decode-0", clock=now), FakeChild("decode-1", clock=now)], RestartPolicy(limit=0),
                     said.append, clock=lambda: now[0])
    off.serving = True
    off.children[0].code = -9
    assert off.tick() is off.children[0] and "restarts are off" in said[-1]


def test_before_the_stack_served_a_worker_that_keeps_dying_stops_it():
    now = [0.0]
    w0, w1 = FakeChild("decode-0", clock=now), FakeChild("decode-1", clock=now)
    sup = Supervisor([w0, w1], RestartPolicy(limit=0), [].append, clock=lambda: now[0])
    w0.code = 2
    assert sup.tick() is w0  # a bad flag, say: every worker would die the same way


def test_supervisor_forgives_a_child_that_ran_long():
    now = [0.0]
    redis = FakeChild("redis", clock=now)
    said: list[str] = []
    sup = Supervisor([redis], RestartPolicy(limit=1, backoff_s=0.1, reset_after_s=20), said.append,
                     clock=lambda: now[0])
    for death in range(4):  # each after a long run: never a second death in a row
        now[0] += 25.0
        redis.code = -9
        assert sup.tick() is None
        now[0] += 0.1
        assert sup.tick() is None
    assert len(redis.starts) == 4 and sup.restarts == 4


def test_duet_up_waits_for_each_workers_ready_line_from_its_current_start(tmp_path):
    """Real child processes: a worker counts as ready once the start now running printed its ready
    line (an earlier start's line in the same log does not count, nor a line of a worker that has
    died since); other children are not waited for."""
    import sys
    import time

    def child(name: str, kind: str, delay_s: float) -> Child:
        code = f"import time, sys; time.sleep({delay_s}); print('duet decode worker {name} ready: grpc x', " \
               "file=sys.stderr, flush=True); time.sleep(30)"
        return Child(name, [sys.executable, "-c", code], tmp_path / f"{name}.log", kind=kind)

    fast, slow, router = child("decode-0", "worker", 0.0), child("prefill-0", "worker", 4.0), child("router", "router", 99)
    try:
        for c in (fast, slow, router):
            c.start()
        deadline = time.monotonic() + 30

        def wait_until(want: list[str], children: list[Child]) -> None:
            while (now := workers_not_ready(children)) != want:
                assert time.monotonic() < deadline, now
                time.sleep(0.05)

        wait_until(["prefill-0"], [fast, slow, router])  # the fast one printed; the router is never waited for
        wait_until([], [fast, slow, router])
        fast.kill()
        assert workers_not_ready([fast]) == ["decode-0"], "a worker that died is not ready, whatever it printed"
        fast.start()  # a restart: the line the first start wrote is before this start's offset
        assert "ready" in fast.log_path.read_text() and workers_not_ready([fast]) == ["decode-0"]
        wait_until([], [fast])
    finally:
        for c in (fast, slow, router):
            c.kill()


def test_describe_exit():
    assert describe_exit(2) == "code 2" and describe_exit(-15) == "code -15 (SIGTERM)"


def test_drain_plan_fits_the_workers_inside_the_gateways_grace():
    for grace, worker in ((10.0, 7.0), (3.0, 1.5), (60.0, 57.0), (0.0, 0.0)):
        plan = DrainPlan(grace)
        assert plan.gateway_grace_s == grace and plan.worker_grace_s == worker
        assert plan.kill_after_s == grace + KILL_AFTER_S


@dataclass
class StoppingChild:
    """Exits `takes_s` after SIGTERM (None: never), on a shared fake clock."""

    name: str
    kind: str
    takes_s: float | None
    clock: list[float]
    termed_at: float | None = None
    killed: bool = False

    @property
    def running(self) -> bool:
        if self.killed:
            return False
        return self.termed_at is None or self.takes_s is None or self.clock[0] < self.termed_at + self.takes_s

    def terminate(self) -> None:
        if self.running and self.termed_at is None:
            self.termed_at = self.clock[0]

    def kill(self) -> None:
        self.killed = True


def run_stop(children, grace: float, now: list[float]) -> list[str]:
    said: list[str] = []

    def sleep(dt: float) -> None:
        now[0] += dt
    stop_children(children, DrainPlan(grace), said.append, clock=lambda: now[0], sleep=sleep)
    return said


def test_stop_signals_in_dependency_order_and_kills_only_at_the_deadline():
    now = [0.0]
    gateway, worker = StoppingChild("gateway", "gateway", 1.0, now), StoppingChild("decode-0", "worker", 4.0, now)
    router, redis = StoppingChild("router", "router", 2.0, now), StoppingChild("redis", "redis", 0.1, now)
    said = run_stop([redis, router, worker, gateway], 3.0, now)
    assert said == [] and not any(c.killed for c in (gateway, worker, router, redis))
    assert gateway.termed_at == worker.termed_at == 0.0
    assert 1.0 <= router.termed_at < 1.1  # once the gateway is gone, while the worker still drains
    assert 4.0 <= redis.termed_at < 4.1  # once the workers and router are gone
    assert now[0] < 4.3

    now = [0.0]
    stuck = StoppingChild("prefill-0", "worker", None, now)
    redis = StoppingChild("redis", "redis", 0.1, now)
    said = run_stop([redis, stuck, StoppingChild("gateway", "gateway", 0.5, now)], 3.0, now)
    assert stuck.killed and said == [f"prefill-0 still running {3 + KILL_AFTER_S:g}s after SIGTERM; killing it"]
    assert redis.termed_at is None and redis.killed  # it waited for the worker, then went with it
    assert now[0] == pytest.approx(3.0 + KILL_AFTER_S, abs=0.1)


def test_restart_settings_are_flags_and_variables():
    cfg = UpConfig.from_argv(["--restart-limit", "2", "--restart-backoff", "0.5"],
                             {"DUET_RESTART_RESET": "15", "DUET_DRAIN_GRACE": "4"})
    assert (cfg.restart_limit, cfg.restart_backoff_s, cfg.restart_reset_s, cfg.drain_grace_s) == (2, 0.5, 15.0, 4.0)
    assert UpConfig.from_argv([], {}).restart_limit == 5


def test_secure_unless_insecure_and_no_certificates_of_ones_own():
    assert not UpConfig.from_argv([], {}).insecure
    assert UpConfig.from_argv(["--insecure"], {}).insecure and UpConfig.from_argv([], {"DUET_INSECURE": "1"}).insecure
    for argv in (["--secure"], ["--grpc-tls-cert-file", "c", "--grpc-tls-key-file", "k"]):
        with pytest.raises(SystemExit):  # the default; duet up makes each child's certificate itself
            UpConfig.from_argv(argv, {})


def mutual_handshake(server: CertFiles, client: CertFiles, hostname: str) -> None:
    """A TLS handshake in memory between a server that requires a client certificate and a
    client that presents one and checks the server's name: raises ssl.SSLError if either refuses."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(server.cert, server.key)
    server_ctx.load_verify_locations(server.ca)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.create_default_context(cafile=client.ca)
    client_ctx.load_cert_chain(client.cert, client.key)
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    server_end = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    client_end = client_ctx.wrap_bio(c_in, c_out, server_hostname=hostname)
    done = set()
    for _ in range(20):
        for side, out, peer_in in ((client_end, c_out, s_in), (server_end, s_out, c_in)):
            try:
                side.do_handshake()
                done.add(id(side))
            except ssl.SSLWantReadError:
                pass
            peer_in.write(out.read())
        if len(done) == 2:
            return
    raise AssertionError("handshake did not finish")


def test_make_secure_issues_each_child_its_identity_and_a_redis_password_in_private_files():
    vault = SecretsDir()
    try:
        made = make_secure(UpConfig.from_argv(["--prefill", "1", "--decode", "2", "--planner", "off"], {}), vault,
                           own_redis=True)
        certs = made.certs
        assert set(certs) == {"router", "gateway", "prefill-0", "decode-0", "decode-1"}
        files = [made.redis_password_file, made.redis_config_file,
                 *(f for c in certs.values() for f in (c.cert, c.key, c.ca))]
        assert vault.path.stat().st_mode & 0o777 == 0o700
        assert all(f.parent == vault.path and f.stat().st_mode & 0o777 == 0o600 for f in files)
        password = made.redis_password_file.read_text().strip()
        assert len(password) >= 32 and made.redis_config_file.read_text() == f"requirepass {password}\n"
        assert made.child_env()["DUET_REDIS_PASSWORD_FILE"] == str(made.redis_password_file)
        assert made.child_env()["DUET_REDIS_PASSWORD"] == "" and made.child_env()["DUET_GRPC_TLS_CERT_FILE"] == ""
        assert made.grpc_args("decode-1") == ["--grpc-tls-cert-file", str(certs["decode-1"].cert),
                                              "--grpc-tls-key-file", str(certs["decode-1"].key),
                                              "--grpc-tls-ca-file", str(certs["decode-1"].ca)]
        for who in certs.values():
            assert who.cert.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
        gateway = certs["gateway"]  # each server answers the gateway under its own name only
        for server, name in (("router", server_name("router")), ("decode-1", server_name("decode", "decode-1")),
                             ("prefill-0", server_name("prefill", "prefill-0"))):
            mutual_handshake(certs[server], gateway, name)
        for server, name in (("decode-0", server_name("decode", "decode-1")), ("router", "127.0.0.1"),
                             ("prefill-0", server_name("decode", "prefill-0"))):
            with pytest.raises(ssl.SSLError):
                mutual_handshake(certs[server], gateway, name)
        other = SecretsDir()
        try:  # another run's CA trusts none of these
            external = make_secure(UpConfig.from_argv([], {}), other, own_redis=False)
            with pytest.raises(ssl.SSLError):
                mutual_handshake(certs["router"], external.certs["gateway"], server_name("router"))
            assert external.redis_password_file is None  # a --redis-url Redis is secured by whoever runs it
            assert "DUET_REDIS_PASSWORD_FILE" not in external.child_env()
        finally:
            other.close()
    finally:
        vault.close()
    assert not files[0].exists()


def test_with_the_planner_every_worker_is_certified_to_take_any_role_and_the_planner_to_switch_it():
    from shared.security.identity import certificate_identity
    cfg = UpConfig.from_argv(["--prefill", "1", "--decode", "2"], {})  # the planner is on by default
    assert cfg.switchable and cfg.worker_names() == [("prefill", "worker-0"), ("decode", "worker-1"),
                                                     ("decode", "worker-2")]
    assert UpConfig.from_argv(["--planner", "off", "--both", "2", "--prefill", "0", "--decode", "0"],
                              {}).worker_names() == [("both", "both-0"), ("both", "both-1")]
    vault = SecretsDir()
    try:
        certs = make_secure(cfg, vault, own_redis=False).certs
        assert set(certs) == {"router", "gateway", "planner", "worker-0", "worker-1", "worker-2"}
        who = {name: certificate_identity(files.cert.read_bytes()) for name, files in certs.items()}
        assert {(i.role, i.worker_id) for n, i in who.items() if n.startswith("worker-")} == \
            {("worker", "worker-0"), ("worker", "worker-1"), ("worker", "worker-2")}
        assert (who["planner"].role, who["planner"].worker_id) == ("planner", "")
        # a switchable worker answers as a prefill and as a decode worker, by its own name only
        for service in ("prefill", "decode"):
            mutual_handshake(certs["worker-1"], certs["gateway"], server_name(service, "worker-1"))
        with pytest.raises(ssl.SSLError):
            mutual_handshake(certs["worker-1"], certs["gateway"], server_name("decode", "worker-2"))
    finally:
        vault.close()


def test_the_banner_names_the_registry_with_its_password_file_and_the_certificates(tmp_path):
    password = tmp_path / "redis-password"
    password.write_text("s3cret\n")
    banner = (f"  redis   redis://127.0.0.1:6390/0 (password required: {password})\n"
              f"  gRPC    mutual TLS, a certificate per service from a throwaway CA ({tmp_path}); ...\n")
    assert registry_url_in(banner) == "redis://:s3cret@127.0.0.1:6390/0" and certificates_in(banner) == tmp_path
    insecure = "  redis   redis://127.0.0.1:6390/0\n  gRPC    plaintext, open to every local process (--insecure)\n"
    assert registry_url_in(insecure) == "redis://127.0.0.1:6390/0" and certificates_in(insecure) is None


def test_cryptography_is_a_dependency_of_a_plain_install():
    """duet up makes its certificates with `cryptography` by default: it may not be a dev-only extra."""
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert '"cryptography' in deps, deps
