"""What `duet up` prints once its stack serves (stderr; the API URL alone on stdout), and
reading it back: scripts and tests that drive a `duet up` find its registry there, with the
password from the file the banner names (same user: the file is 0600 in a 0700 folder)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from shared.security.secret_files import redact_url

INSECURE_WARNING = ("INSECURE (--insecure): gRPC is plaintext and any local process may call the router and "
                    "the workers directly (route, reserve KV pages, prefill, generate: past the gateway's API keys "
                    "and limits), and Redis has no password (any local process may register a fake worker)")


def _security_lines(stack) -> tuple[str, str]:
    """The banner's Redis note and its gRPC line."""
    secure = stack.secure
    redis_auth = f" (password required: {secure.redis_password_file})" if secure.redis_password_file else ""
    if not secure.mutual_tls:
        return redis_auth, "plaintext, open to every local process (--insecure)"
    folder = secure.certs["gateway"].cert.parent
    return redis_auth, (f"mutual TLS, a certificate per service from a throwaway CA ({folder}); each caller "
                        f"may call only what its role needs")


def _models_line(model_dirs: list[str]) -> str:
    if len(model_dirs) == 1:
        return f"  model   {model_dirs[0]}\n"
    return f"  models  {model_dirs[0]} (default), {', '.join(model_dirs[1:])}\n"


def _planner_line(stack) -> str:
    cfg = stack.cfg
    if not cfg.switchable:
        return "  planner off: every worker keeps its role\n"
    return (f"  planner on: switches the workers' roles as the load asks (metrics {cfg.host}:"
            f"{stack.planner_metrics_port}, log planner.log" + (", one per model" if len(cfg.models) > 1 else "")
            + ")\n")


def print_banner(stack, model_dirs: list[str], base: str) -> None:
    """What `duet up` says once the gateway is healthy (stack: main.Stack)."""
    cfg = stack.cfg
    workers = [c.name + (f" (GPU {c.env['CUDA_VISIBLE_DEVICES']})" if "CUDA_VISIBLE_DEVICES" in c.env else "")
               for c in stack.children if c.kind == "worker"]
    redis_auth, grpc_line = _security_lines(stack)
    restarts = (f"A child that dies is restarted (up to {cfg.restart_limit} times in a row)" if cfg.restart_limit
                else "A child that dies stops the stack (--restart-limit 0)")
    warning = f"{INSECURE_WARNING}.\n" if cfg.insecure else ""
    processes = cfg.gateway_processes
    metrics = (f"metrics {base}/metrics" if processes == 1 else
               f"{processes} gateway processes, metrics on each: "
               + ", ".join(u.removesuffix("/metrics") for u in stack.gateway_metrics_urls()))
    print(f"\nDuet is up. OpenAI API: {base}/v1   (health {base}/health, {metrics})\n"
          f"{warning}"
          f"{_models_line(model_dirs)}"
          f"  router  {cfg.host}:{stack.router_port}\n"
          f"  workers {', '.join(workers)}\n"
          f"{_planner_line(stack)}"
          f"  redis   {redact_url(stack.redis_url)}{redis_auth}\n"
          f"  auth    {'API key required' if cfg.api_keys or cfg.api_keys_file else 'none (open)'}\n"
          f"  gRPC    {grpc_line}\n"
          f"  logs    {stack.log_dir}\n"
          f"{restarts}; Ctrl-C stops everything (drain: {stack.drain.grace_s:g}s).\n", file=sys.stderr, flush=True)
    print(f"{base}/v1", flush=True)  # stdout: the one thing a script needs


def registry_url_in(banner: str) -> str | None:
    """The Redis URL a `duet up` banner names, with its password when it requires one."""
    m = re.search(r"^  redis   (redis://\S+)( \(password required: (\S+)\))?$", banner, re.M)
    if m is None:
        return None
    url = m.group(1)
    if m.group(3):
        password = Path(m.group(3)).read_text().strip()
        url = url.replace("redis://", f"redis://:{password}@", 1)
    return url


def certificates_in(banner: str) -> Path | None:
    """The folder of the stack's gRPC certificates (<child>.crt, <child>.key, grpc-ca.crt);
    None with --insecure."""
    m = re.search(r"throwaway CA \((\S+)\)", banner)
    return Path(m.group(1)) if m else None
