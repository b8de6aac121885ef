"""`duet up`: the whole stack as local processes with one command.

Starts redis-server (unless --redis-url), the router, the prefill/decode (or both)
workers and the gateway; waits until every worker reports ready and the gateway's /health
says it can serve; prints where everything is; supervises every child (supervisor.py: a child
that dies is started again with backoff, and duet up gives up with exit code 1 when one keeps
dying, except a worker of a stack that has served while others run: left down, tried again
later); Ctrl-C or SIGTERM drains the whole stack within one grace period (shutdown.py)."""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from services.launcher.banner import INSECURE_WARNING, print_banner
from services.launcher.children import Child, duet_command, thread_env
from services.launcher.config import UpConfig, auto_gateway_processes
from services.launcher.gpus import WorkerFlags, gpu_memory_bytes, host_available_bytes, visible_gpus, weight_bytes
from services.launcher.gpus import plan as place_workers
from services.launcher.ports import free_port, port_taken
from services.launcher.redis_process import redis_child, wait_ready
from services.launcher.restart_policy import RestartPolicy
from services.launcher.security import SecretsDir, SecureStack, gateway_security, health_ssl_context, make_secure
from services.launcher.shutdown import DrainPlan, stop_children
from services.launcher.supervisor import Supervisor

log = logging.getLogger("duet.up")


def say(message: str) -> None:
    print(f"duet up: {message}", file=sys.stderr, flush=True)


def _healthy(url: str, context=None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as r:
            return r.status == 200
    except OSError:
        return False


def template_helpers(cores: int) -> int:
    """The gateway's chat-template helpers on a machine of `cores`: every turn of a conversation is
    rendered and tokenized whole, so a burst of follow-ups queues for them (docs/performance/
    multiturn.md). Half the cores, 2 to 8 (each helper holds a tokenizer: ~120 MB with the default model's)."""
    return max(2, min(8, cores // 2))


class Stack:
    def __init__(self, cfg: UpConfig, log_dir: Path):
        self.cfg = cfg
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.redis_url = cfg.redis_url
        self.stopped = False
        self.secrets = SecretsDir()
        self.secure = SecureStack()  # --insecure keeps this: plaintext gRPC, Redis without a password
        self.drain = DrainPlan(cfg.drain_grace_s)

    def make_secure(self) -> None:
        self.secure = make_secure(self.cfg, self.secrets, own_redis=self.redis_url is None)

    def start_redis(self) -> None:
        host = self.cfg.host
        port = free_port(host)
        child = redis_child(self.log_dir, self.log_dir / "redis.log", host, port, self.secure.redis_config_file)
        self.children.append(child)
        child.start()
        self.redis_url = wait_ready(child, host, port)

    def plan(self, model_dirs: list[str]) -> None:
        """Every child's command line: one pool of workers per model (model_dirs, the default
        model first), one router and one gateway for all, and with the planner on a planner per
        model (each switches roles within its own model's pool only)."""
        cfg, host = self.cfg, self.cfg.host
        flags = WorkerFlags.parse(cfg.worker_args)
        gpus = [] if flags.device.startswith("cpu") else visible_gpus()
        pools = [(model_dir, role, name) for i, model_dir in enumerate(model_dirs)
                 for role, name in cfg.worker_names(i)]
        roles = [(role, name) for _, role, name in pools]
        tps = [cfg.role_tp(role, flags.tp) for role, _ in roles]
        self.placements = place_workers(len(pools), flags, gpus, explicit_kv=cfg.kv_cache_memory,
                                        card_bytes=gpu_memory_bytes() if gpus else 0,
                                        model_bytes=max(map(weight_bytes, model_dirs)) if gpus else 0, tps=tps,
                                        # a switchable worker may decode: it weighs as `both`
                                        roles=["both" if cfg.switchable else role for role, _ in roles],
                                        host_bytes=host_available_bytes() if gpus else 0)
        cores = os.cpu_count() or 1
        if not cfg.gateway_processes:
            # workers sharing a GPU stream one GPU's worth between them
            cfg.gateway_processes = auto_gateway_processes(min(len(gpus), len(pools)), cores)
        threads = cfg.threads or max(1, cores // max(1, len(pools)))
        self.router_port = free_port(host)
        common = ["--redis-url", self.redis_url]
        itl = ["--slo-itl-ms", f"{cfg.slo.itl_ms:g}"] if cfg.slo.itl_ms else []  # router, workers, planner
        ttft = ["--slo-ttft-ms", f"{cfg.ttft.ttft_ms:g}"] if cfg.ttft.ttft_ms else []  # workers, planner
        secure, secure_env = self.secure, self.secure.child_env()
        self.children.append(Child("router", duet_command(
            "router", "--host", host, "--port", str(self.router_port), "--metrics-port", str(free_port(host)),
            *common, *itl, *cfg.overflow_flags(os.environ), *secure.grpc_args("router")),
            self.log_dir / "router.log", kind="router",
            env={**thread_env(1), **secure_env}))
        for (model_dir, role, name), place, tp in zip(pools, self.placements, tps):
            kv = ["--kv-cache-memory", place.kv_cache_memory] if place.kv_cache_memory else []
            if place.kv_host_memory:
                kv += ["--kv-host-memory", place.kv_host_memory]
            role_tp = ["--tp", str(tp)] if tp != flags.tp else []  # after the shared flags: it wins
            argv = duet_command("worker", "--role", role, "--worker-id", name, "--host", host,
                                "--port", str(free_port(host)),  # metrics: bound on any free port, published
                                "--model", model_dir, *kv, "--threads", str(threads),
                                "--drain-grace", str(self.drain.worker_grace_s), *common, *itl, *ttft,
                                *(["--switchable"] if cfg.switchable else []),
                                *secure.grpc_args(name), *cfg.worker_args, *role_tp)
            self.children.append(Child(name, argv, self.log_dir / f"{name}.log", kind="worker",
                                       env={**thread_env(threads), **place.env(), **secure_env}))
        gw_args, gw_env = gateway_security(cfg, self.secrets)
        self.gateway_metrics_ports = self.plan_gateway_metrics()
        if cfg.switchable:
            self.add_planners(common, itl + ttft, [Path(d).name for d in model_dirs])
        processes = cfg.gateway_processes
        # the chat-template helpers are shared out among the gateway processes (at least one each)
        helpers = max(1, -(-(cfg.chat_template_processes or template_helpers(cores)) // processes))
        extra_models = [arg for d in model_dirs[1:] for arg in ("--extra-model", d)]
        for i in range(processes):
            own = (["--metrics-port", str(self.gateway_metrics_ports[i])] if self.gateway_metrics_ports else []) + \
                (["--reuse-port", "--gateways", str(processes)] if processes > 1 else [])
            name = f"gateway-{i}" if i else "gateway"
            self.children.append(Child(name, duet_command(
                "gateway", "--host", host, "--port", str(cfg.port), "--router-address", f"{host}:{self.router_port}",
                "--model", model_dirs[0], *extra_models, "--drain-grace", str(self.drain.gateway_grace_s),
                "--chat-template-processes", str(helpers), *common, *secure.grpc_args("gateway"), *gw_args, *own,
                *(["--enable-lora-loading"] if cfg.enable_lora_loading else [])),
                self.log_dir / f"{name}.log", kind="gateway", env={**thread_env(1), **gw_env, **secure_env}))
        self.threads = threads

    def plan_gateway_metrics(self) -> list[int]:
        """The gateway processes' own /metrics ports: none for one gateway on plain HTTP (it
        serves /metrics on the API port); one each when the API port serves HTTPS (the planner
        reads plain HTTP) for the planner, or when several processes share the API port (a
        scrape there reaches any one of them)."""
        cfg = self.cfg
        if cfg.gateway_processes == 1 and not (cfg.tls_cert_file and cfg.switchable):
            return []
        return [free_port(cfg.host) for _ in range(cfg.gateway_processes)]

    def gateway_metrics_urls(self) -> list[str]:
        host = self.cfg.host
        dial = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        ports = self.gateway_metrics_ports or [self.cfg.port]
        return [f"http://{dial}:{port}/metrics" for port in ports]

    def add_planners(self, common: list[str], slos: list[str], names: list[str]) -> None:
        """The planner child, reading every gateway process's /metrics. Several models: a planner
        each (`planner`, `planner-m1`, ...), each given its model's name, so it reads that model's
        workers and gateway figures and switches roles within that pool only."""
        host = self.cfg.host
        gateways = [arg for url in self.gateway_metrics_urls() for arg in ("--gateway-metrics", url)]
        for i, name in enumerate(names):
            child = f"planner-m{i}" if i else "planner"
            port = free_port(host)
            if not i:
                self.planner_metrics_port = port
            model = ["--model", name] if len(names) > 1 else []  # one model: every worker is its
            self.children.append(Child(child, duet_command(
                "planner", "--host", host, "--metrics-port", str(port), *model,
                *gateways, *common, *slos, *self.secure.grpc_args("planner")),
                self.log_dir / f"{child}.log", kind="planner", env={**thread_env(1), **self.secure.child_env()}))

    def start(self) -> None:
        for child in self.children:
            if child.proc is None:
                child.start()

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        stop_children(self.children, self.drain, say)
        self.secrets.close()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = UpConfig.from_argv(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s duet up: %(message)s")
    if port_taken(cfg.host, cfg.port):
        say(f"port {cfg.port} on {cfg.host} is in use; pick another with --port")
        return 2
    from shared.model_files.default_model import resolve_model_dir
    try:
        # converts the default model once, with progress
        model_dirs = [str(resolve_model_dir(m)) for m in cfg.models or [None]]
    except (FileNotFoundError, ValueError) as exc:
        say(str(exc))
        return 2
    names = [Path(d).name for d in model_dirs]
    if len(set(names)) < len(names):
        say(f"two --model folders have the same name ({', '.join(names)}): each model is served under its "
            "folder's name, so give them folders of different names")
        return 2
    log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="duet-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(cfg, log_dir)
    stopping = {"sig": None}

    def on_signal(signum, _frame):
        stopping["sig"] = signum
    # Restored on return: `duet up` called in-process (tests, scripts) must not leave its handlers behind.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(stack, model_dirs, stopping)
    finally:
        try:
            started = time.monotonic()
            had_children = bool(stack.children)
            if had_children:
                say(f"stopping: every child drains for up to {stack.drain.grace_s:g}s")
            stack.stop()
            if had_children:
                say(f"stopped ({time.monotonic() - started:.1f}s)")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _serve(stack: Stack, model_dirs: list[str], stopping: dict) -> int:
    try:
        if stack.cfg.insecure:
            say(INSECURE_WARNING)
        else:
            stack.make_secure()
        if stack.redis_url is None:
            stack.start_redis()
        stack.plan(model_dirs)
    except FileNotFoundError as exc:  # no redis-server on PATH
        say(str(exc))
        return 2
    except ImportError as exc:  # an install without `cryptography` (a dependency)
        say(f"the stack's certificates need the `cryptography` package ({exc}); or run with --insecure")
        return 2
    except ValueError as exc:  # e.g. --tp larger than the visible GPUs
        say(str(exc))
        return 2
    except RuntimeError as exc:  # redis-server would not start
        say(str(exc))
        return 1
    cfg = stack.cfg
    stack.start()
    supervisor = Supervisor(stack.children, RestartPolicy(cfg.restart_limit, cfg.restart_backoff_s,
                                                          cfg.restart_reset_s, cfg.restart_retry_s), say)
    base = f"{cfg.scheme}://{cfg.host}:{cfg.port}"
    log.info("starting %d %sworkers (%d prefill, %d decode, %d both per model%s; %d threads each), logs in %s",
             cfg.num_workers, "switchable " if cfg.switchable else "", cfg.prefill, cfg.decode, cfg.both,
             " to start with; the planner moves them" if cfg.switchable else "", stack.threads, stack.log_dir)
    deadline = time.monotonic() + cfg.health_timeout_s
    probe_ssl = health_ssl_context(cfg)
    while (waiting := workers_not_ready(stack.children)) or not _healthy(base + "/health", probe_ssl):
        if stopping["sig"] is not None:
            return 130
        if supervisor.tick() is not None:
            return _gave_up()
        if time.monotonic() > deadline:
            what = f"workers {', '.join(waiting)} did not report ready" if waiting else \
                "the gateway did not become healthy"
            say(f"{what} in {cfg.health_timeout_s:.0f}s; logs in {stack.log_dir}")
            return 1
        time.sleep(0.25)
    print_banner(stack, model_dirs, base)
    supervisor.serving = True
    while stopping["sig"] is None:
        if supervisor.tick() is not None:
            return _gave_up()
        time.sleep(0.25)
    return 0


def workers_not_ready(children: list[Child]) -> list[str]:
    """The workers whose current start has not printed its ready line (services/worker/host.py,
    after it registered). The gateway is healthy as soon as it can serve, by decode workers alone
    when no prefill worker is live, so without this wait the first requests after the banner ran
    in a layout the user did not ask for (a decode worker prefilling every prompt itself)."""
    return [c.name for c in children
            if c.kind == "worker" and not (c.running and c.wrote_since_start(f" {c.name} ready: "))]


def _gave_up() -> int:
    say("a child keeps dying: stopping the stack (exit code 1)")
    return 1
