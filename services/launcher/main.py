"""`duet up`: the whole stack as local processes with one command.

Starts redis-server (unless --redis-url), the router, the prefill/decode (or both)
workers and the gateway; waits until the gateway's /health says it can serve; prints
where everything is; reports a child that dies; Ctrl-C or SIGTERM stops everything."""
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

from services.launcher.children import Child, duet_command, thread_env
from services.launcher.config import UpConfig
from services.launcher.gpus import WorkerFlags, gpu_memory_bytes, visible_gpus, weight_bytes
from services.launcher.gpus import plan as place_workers
from services.launcher.ports import port_taken
from services.launcher.redis_process import free_port, start_redis
from services.launcher.security import SecretsDir, gateway_security, grpc_tls_args, health_ssl_context
from shared.security.secret_files import redact_url

log = logging.getLogger("duet.up")


def _healthy(url: str, context=None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as r:
            return r.status == 200
    except OSError:
        return False


class Stack:
    def __init__(self, cfg: UpConfig, log_dir: Path):
        self.cfg = cfg
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.redis_proc = None
        self.redis_url = cfg.redis_url
        self.stopping = False
        self.secrets = SecretsDir()

    def plan(self, model_dir: str) -> None:
        cfg, host = self.cfg, self.cfg.host
        flags = WorkerFlags.parse(cfg.worker_args)
        gpus = [] if flags.device.startswith("cpu") else visible_gpus()
        roles = [(role, i) for role, count in (("prefill", cfg.prefill), ("decode", cfg.decode), ("both", cfg.both))
                 for i in range(count)]
        tps = [cfg.role_tp(role, flags.tp) for role, _ in roles]
        self.placements = place_workers(cfg.num_workers, flags, gpus, explicit_kv=cfg.kv_cache_memory,
                                        card_bytes=gpu_memory_bytes() if gpus else 0,
                                        model_bytes=weight_bytes(model_dir) if gpus else 0, tps=tps)
        cores = os.cpu_count() or 1
        threads = cfg.threads or max(1, cores // max(1, cfg.num_workers))
        self.router_port = free_port(host)
        common = ["--redis-url", self.redis_url, *grpc_tls_args(cfg)]
        self.children.append(Child("router", duet_command(
            "router", "--host", host, "--port", str(self.router_port), "--metrics-port", str(free_port(host)),
            *common), self.log_dir / "router.log", critical=True, env=thread_env(1)))
        for (role, i), place, tp in zip(roles, self.placements, tps):
            name = f"{role}-{i}"
            kv = ["--kv-cache-memory", place.kv_cache_memory] if place.kv_cache_memory else []
            role_tp = ["--tp", str(tp)] if tp != flags.tp else []  # after the shared flags: it wins
            argv = duet_command("worker", "--role", role, "--worker-id", name, "--host", host,
                                "--port", str(free_port(host)), "--metrics-port", str(free_port(host)),
                                "--model", model_dir, *kv, "--threads", str(threads), *common, *cfg.worker_args,
                                *role_tp)
            self.children.append(Child(name, argv, self.log_dir / f"{name}.log", critical=False,
                                       env={**thread_env(threads), **place.env()}))
        gw_args, gw_env = gateway_security(cfg, self.secrets)
        self.children.append(Child("gateway", duet_command(
            "gateway", "--host", host, "--port", str(cfg.port), "--router-address", f"{host}:{self.router_port}",
            "--model", model_dir, *common, *gw_args), self.log_dir / "gateway.log", critical=True,
            env={**thread_env(1), **gw_env}))
        self.threads = threads

    def start(self) -> None:
        for child in self.children:
            child.start()

    def check(self) -> Child | None:
        """Report children that died; return a critical one if any."""
        for child in self.children:
            code = child.exit_code
            if code is not None and not child.reported:
                child.reported = True
                print(f"duet up: {child.name} exited with code {code}; last lines of {child.log_path}:\n"
                      f"{child.tail()}", file=sys.stderr, flush=True)
                if child.critical:
                    return child
        if self.redis_proc is not None and self.redis_proc.poll() is not None:
            print("duet up: redis-server exited", file=sys.stderr, flush=True)
            return self.children[0]
        return None

    def stop(self, grace_s: float = 15.0) -> None:
        if self.stopping:
            return
        self.stopping = True
        order = ([c for c in self.children if c.name == "gateway"]
                 + [c for c in self.children if c.name not in ("gateway", "router")]
                 + [c for c in self.children if c.name == "router"])
        for group in (order[:1], order[1:-1], order[-1:]):
            for child in group:
                child.terminate()
            deadline = time.monotonic() + grace_s
            for child in group:
                while child.exit_code is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                child.kill()
        self.secrets.close()
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            try:
                self.redis_proc.wait(5)
            except Exception:
                self.redis_proc.kill()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = UpConfig.from_argv(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s duet up: %(message)s")
    if port_taken(cfg.host, cfg.port):
        print(f"duet up: port {cfg.port} on {cfg.host} is in use; pick another with --port", file=sys.stderr)
        return 2
    from shared.model_files.default_model import resolve_model_dir
    try:
        model_dir = str(resolve_model_dir(cfg.model))  # converts the default model once, with progress
    except (FileNotFoundError, ValueError) as exc:
        print(f"duet up: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="duet-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(cfg, log_dir)
    if stack.redis_url is None:
        try:
            stack.redis_proc, stack.redis_url = start_redis(log_dir, log_dir / "redis.log", cfg.host)
        except FileNotFoundError as exc:
            print(f"duet up: {exc}", file=sys.stderr)
            return 2
    stopping = {"sig": None}

    def on_signal(signum, _frame):
        stopping["sig"] = signum
    # Restored on return: `duet up` called in-process (tests, scripts) must not leave its handlers behind.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(cfg, stack, model_dir, stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(cfg: UpConfig, stack: Stack, model_dir: str, stopping: dict) -> int:
    try:
        stack.plan(model_dir)
    except ValueError as exc:  # e.g. --tp larger than the visible GPUs
        print(f"duet up: {exc}", file=sys.stderr)
        stack.stop()
        return 2
    stack.start()
    base = f"{cfg.scheme}://{cfg.host}:{cfg.port}"
    log.info("starting %d workers (%d prefill, %d decode, %d both; %d threads each), logs in %s",
             cfg.num_workers, cfg.prefill, cfg.decode, cfg.both, stack.threads, stack.log_dir)
    deadline = time.monotonic() + cfg.health_timeout_s
    code = 0
    try:
        probe_ssl = health_ssl_context(cfg)
        while not _healthy(base + "/health", probe_ssl):
            if stopping["sig"] is not None:
                return 130
            dead = stack.check()
            if dead is not None:
                return 1
            if time.monotonic() > deadline:
                print(f"duet up: the gateway did not become healthy in {cfg.health_timeout_s:.0f}s; "
                      f"logs in {stack.log_dir}", file=sys.stderr)
                return 1
            time.sleep(0.25)
        workers = [c.name + (f" (GPU {c.env['CUDA_VISIBLE_DEVICES']})" if "CUDA_VISIBLE_DEVICES" in c.env else "")
                   for c in stack.children if c.name not in ("gateway", "router")]
        print(f"\nDuet is up. OpenAI API: {base}/v1   (health {base}/health, metrics {base}/metrics)\n"
              f"  model   {model_dir}\n"
              f"  router  {cfg.host}:{stack.router_port}\n"
              f"  workers {', '.join(workers)}\n"
              f"  redis   {redact_url(stack.redis_url)}\n"
              f"  auth    {'API key required' if cfg.api_keys or cfg.api_keys_file else 'none (open)'}; "
              f"gRPC {'mTLS' if cfg.grpc_tls_ca_file else 'TLS' if cfg.grpc_tls_cert_file else 'plaintext'}\n"
              f"  logs    {stack.log_dir}\n"
              f"Ctrl-C stops everything.\n", file=sys.stderr, flush=True)
        print(f"{base}/v1", flush=True)  # stdout: the one thing a script needs
        while stopping["sig"] is None:
            dead = stack.check()
            if dead is not None:
                code = 1
                break
            time.sleep(0.5)
        return code
    finally:
        print("duet up: stopping", file=sys.stderr, flush=True)
        stack.stop()
