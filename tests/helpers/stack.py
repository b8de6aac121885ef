"""Start Duet's real processes for end-to-end tests, read their metrics, clean up.

Two ways to run the stack:

* `DuetUp`: `duet up` as one subprocess (it starts redis, router, workers, gateway), secure as
  the product's default (its Redis password and each child's gRPC certificate are read from the
  files duet up names; `grpc_channel()` dials as one of its children) unless given --insecure;
* `ProcessStack`: redis (tests/helpers/redis_server.py), router, workers and gateway as separate
  subprocesses, for tests that kill, stop or add one.

Both give `base_url`, `client()`, the registry (`workers()`), each worker's scraped
`/metrics` (`metrics(worker_id)`, address read from its registry entry), and keep every
process's log in a temp folder; `report_logs()` returns their tails for failure output.
Every process runs with one intra-op thread (the machine has two cores and several
processes). Children are started in their own session and always stopped (SIGTERM, then
SIGKILL by pid / by the group we created).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import redis

from tests.helpers.redis_server import RedisServer, free_port

REPO = Path(__file__).resolve().parents[2]
PREFIX = "duet"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", "DUET_DRAIN_GRACE": "3"})
    env.pop("DUET_REDIS_URL", None)
    env.update(extra or {})
    return env


def duet_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


class ProcessExited(RuntimeError):
    """A stack process the wait depends on has exited: wait_until gives up at once."""


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Poll predicate() until it returns something truthy; raise with `what` on timeout."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except ProcessExited:
            raise
        except Exception as exc:  # a scrape can fail while a process starts
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}"
                       + (f" (last error: {last_exc})" if last_exc else ""))


# --- processes ---------------------------------------------------------------------------

@dataclass
class Process:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=child_env)
    popen: subprocess.Popen | None = None

    def start(self) -> "Process":
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=self.env, cwd=REPO,
                                          start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            self.popen.send_signal(sig)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, wait, then SIGKILL whatever is left of the session we created."""
        if self.popen is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # the group is ours (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


# --- metrics -----------------------------------------------------------------------------

@dataclass
class Metrics:
    """One scrape of a Prometheus /metrics page."""

    samples: list[tuple[str, dict[str, str], float]]

    @classmethod
    def parse(cls, text: str) -> "Metrics":
        from prometheus_client.parser import text_string_to_metric_families
        out = []
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.append((s.name, dict(s.labels), float(s.value)))
        return cls(out)

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples named `name` whose labels include `labels` (0 if none)."""
        return sum(v for n, lab, v in self.samples
                   if n == name and all(lab.get(k) == want for k, want in labels.items()))

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)


def scrape(address: str, timeout: float = 5.0) -> Metrics:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as r:
        return Metrics.parse(r.read().decode())


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


# --- the stack, whichever way it runs ----------------------------------------------------

class _StackBase:
    base_url: str
    redis_url: str
    log_dir: Path

    def __init__(self):
        self._metrics_addresses: dict[str, str] = {}
        self._redis: redis.Redis | None = None

    # registry
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis.Redis.from_url(self.redis_url, socket_timeout=2, decode_responses=True)
        return self._redis

    def workers(self) -> dict[str, dict[str, str]]:
        """Registry entries now: worker id -> hash fields."""
        r = self.redis()
        out = {}
        for key in r.scan_iter(f"{PREFIX}:worker:*"):
            rest = key[len(f"{PREFIX}:worker:"):]
            if ":" in rest:  # :nixl / :pages side keys
                continue
            fields = r.hgetall(key)
            if fields:
                out[rest] = fields
        for wid, fields in out.items():
            if fields.get("metrics"):
                self._metrics_addresses[wid] = fields["metrics"]
        return out

    def worker_ids(self, role: str | None = None) -> list[str]:
        return sorted(w for w, f in self.workers().items() if role is None or f.get("role") == role)

    def metrics(self, worker_id: str) -> Metrics:
        if worker_id not in self._metrics_addresses:
            self.workers()
        return scrape(self._metrics_addresses[worker_id])

    def known_workers(self) -> list[str]:
        """Every worker whose metrics address was ever seen (dead ones included)."""
        self.workers()
        return sorted(self._metrics_addresses)

    def gateway_metrics(self) -> Metrics:
        return scrape(self.base_url.removeprefix("http://").removesuffix("/v1"))

    def client(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=self.base_url, api_key="duet-test", max_retries=0,
                             timeout=kwargs.pop("timeout", 120.0), **kwargs)

    def async_client(self, **kwargs):
        import openai
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="duet-test", max_retries=0,
                                  timeout=kwargs.pop("timeout", 120.0), **kwargs)

    @property
    def health_url(self) -> str:
        return self.base_url.removesuffix("/v1") + "/health"

    # the "after any failure, used pages return to zero" rule
    def kv_usage(self, worker_id: str) -> float:
        return self.metrics(worker_id).value("duet_kv_cache_usage_ratio")

    def running(self, worker_id: str) -> float:
        return self.metrics(worker_id).value("duet_running_requests")

    def wait_idle(self, worker_ids: Sequence[str] | None = None, timeout: float = 30.0) -> None:
        """Every (live) worker reads KV usage 0 and no running request."""
        ids = list(worker_ids) if worker_ids is not None else self.worker_ids()

        def idle():
            busy = {w: (self.kv_usage(w), self.running(w)) for w in ids}
            return all(u == 0 and r == 0 for u, r in busy.values()) or None
        try:
            wait_until(idle, timeout, f"KV usage 0 and no running request on {ids}", interval=0.25)
        except TimeoutError:
            state = {}
            for w in ids:
                try:
                    state[w] = (self.kv_usage(w), self.running(w))
                except Exception as exc:
                    state[w] = repr(exc)
            raise AssertionError(f"workers not idle after {timeout:.0f}s: {state}") from None

    def processes(self) -> list[Process]:
        raise NotImplementedError

    def report_logs(self, lines: int = 40) -> str:
        parts = [f"logs in {self.log_dir}"]
        for p in self.processes():
            parts.append(f"----- {p.name} (pid {p.pid if p.popen else '-'}, "
                         f"{'alive' if p.alive else 'exit ' + str(p.popen.returncode if p.popen else None)}) -----")
            parts.append(p.tail(lines))
        for extra in sorted(self.log_dir.glob("*.log")):  # duet up's children
            if all(extra != p.log_path for p in self.processes()):
                parts.append(f"----- {extra.name} -----")
                parts.append("\n".join(extra.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)


class DuetUp(_StackBase):
    """`duet up` as one subprocess. With `planner=False` (the default here) it runs
    `--planner off`: the workers keep the roles the test starts them in (prefill-0, decode-0, ...),
    which is what most tests are about; tests of the planner and of switchable workers pass
    planner=True (duet up's own default: worker-0, worker-1, ... and `duet planner`)."""

    def __init__(self, log_dir: Path, *args: str, kv_cache_memory: str = "64M",
                 worker_args: Sequence[str] = (), env: dict[str, str] | None = None, planner: bool = False):
        super().__init__()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        argv = duet_argv("up", "--port", str(self.port), "--threads", "1", "--log-dir", str(self.log_dir),
                         "--kv-cache-memory", kv_cache_memory, "--health-timeout", "280",
                         "--planner", "on" if planner else "off", *args)
        if worker_args:
            argv += ["--", *worker_args]
        self.proc = Process("duet-up", argv, self.log_dir / "duet-up.out", env=child_env(env))
        self.redis_url = ""
        self.redis_password: str | None = None  # duet up's own Redis (unless --insecure): from wait_ready()
        self.certs_dir: Path | None = None  # every child's gRPC certificate (unless --insecure)

    def processes(self) -> list[Process]:
        return [self.proc]

    def start(self) -> "DuetUp":
        self.proc.start()
        return self

    def wait_ready(self, timeout: float = 300.0) -> "DuetUp":
        def ready():
            if not self.proc.alive:
                raise ProcessExited(f"duet up exited with {self.proc.popen.returncode}")
            text = self.proc.log_text()
            return re.search(r"^  redis   redis://", text, re.M) and re.search(rf"^{re.escape(self.base_url)}$", text, re.M)
        try:
            wait_until(ready, timeout, "duet up to print its URL", interval=0.25)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{exc}\n{self.report_logs()}") from None
        from services.launcher.banner import certificates_in, registry_url_in
        text = self.proc.log_text()
        self.redis_url = registry_url_in(text)  # with the password the banner's file holds
        self.redis_password = urlsplit(self.redis_url).password
        self.certs_dir = certificates_in(text)
        return self

    def grpc_channel(self, address: str, server: str, *, as_child: str = "gateway", aio: bool = False):
        """A gRPC channel to `address` as the child `as_child` ("gateway", "router", a worker id)
        dials: with its certificate, checking the name `server` (shared/security/identity.py:
        server_name) in the server's; plaintext when the stack runs --insecure."""
        import grpc
        module = grpc.aio if aio else grpc
        if self.certs_dir is None:
            return module.insecure_channel(address)
        creds = grpc.ssl_channel_credentials((self.certs_dir / "grpc-ca.crt").read_bytes(),
                                             (self.certs_dir / f"{as_child}.key").read_bytes(),
                                             (self.certs_dir / f"{as_child}.crt").read_bytes())
        return module.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", server)])

    def worker_channel(self, worker_id: str, service: str, *, as_child: str = "gateway", aio: bool = False):
        """A channel to a worker's gRPC (its address from the registry), as `as_child` dials it."""
        from shared.security.identity import server_name
        return self.grpc_channel(self.workers()[worker_id]["address"], server_name(service, worker_id),
                                 as_child=as_child, aio=aio)

    @property
    def router_address(self) -> str:
        return re.search(r"router\s+(\S+:\d+)", self.proc.log_text()).group(1)

    def router_metrics(self) -> Metrics:
        """The router's /metrics (duet up gives it --host and --metrics-port on its command line)."""
        argv = self._child_argv("router")
        return scrape(f"{argv[argv.index('--host') + 1]}:{argv[argv.index('--metrics-port') + 1]}")

    def _child_argv(self, name: str) -> list[str]:
        import psutil
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            argv = child.cmdline()
            if name in argv:
                return argv
        raise RuntimeError(f"duet up has no {name} child")

    def gateway_pid(self) -> int:
        """The gateway child of duet up (its process id, for memory readings)."""
        import psutil
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if "gateway" in child.cmdline():
                return child.pid
        raise RuntimeError("duet up has no gateway child")

    def close(self) -> None:
        self.proc.stop(grace_s=40)
        if self._redis is not None:
            self._redis.close()


def child_process(stack: "DuetUp", marker: str):
    """The live child (a psutil.Process) of duet up whose command line contains `marker`."""
    from loadtest.duet_stack import live_child

    return live_child(stack.proc.pid, marker)


class ProcessStack(_StackBase):
    """redis + router + workers + gateway, each its own subprocess."""

    def __init__(self, log_dir: Path, *, registry_ttl_s: float = 5.0, kv_cache_memory: str = "64M",
                 worker_args: Sequence[str] = (), gateway_args: Sequence[str] = (),
                 router_args: Sequence[str] = ()):
        super().__init__()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.registry_ttl_s = registry_ttl_s
        self.kv_cache_memory = kv_cache_memory
        self.worker_args = list(worker_args)
        self.gateway_args = list(gateway_args)
        self.router_args = list(router_args)
        self.redis_server = RedisServer()
        self.redis_url = self.redis_server.url
        self.procs: dict[str, Process] = {}
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.router_port = free_port()
        self.router_metrics_port = free_port()

    def processes(self) -> list[Process]:
        return list(self.procs.values())

    def _registry_args(self) -> list[str]:
        return ["--redis-url", self.redis_url, "--registry-ttl", str(self.registry_ttl_s),
                "--registry-heartbeat", str(max(0.2, self.registry_ttl_s / 4))]

    def _spawn(self, name: str, argv: list[str]) -> Process:
        if name in self.procs and self.procs[name].alive:
            raise ValueError(f"{name} is already running")
        proc = Process(name, argv, self.log_dir / f"{name}.log").start()
        self.procs[name] = proc
        return proc

    def start_redis(self) -> None:
        self.redis_server.start()

    def start_router(self, extra: Sequence[str] = ()) -> Process:
        return self._spawn("router", duet_argv(
            "router", "--host", "127.0.0.1", "--port", str(self.router_port),
            "--metrics-port", str(self.router_metrics_port), *self._registry_args(), *self.router_args, *extra))

    def router_decisions(self, kind: str) -> float:
        """The router's answers of one kind so far (split, colocated, local_prefill, unavailable)."""
        return scrape(f"127.0.0.1:{self.router_metrics_port}").value("duet_router_decisions_total", kind=kind)

    def add_worker(self, role: str, worker_id: str, extra: Sequence[str] = ()) -> Process:
        return self._spawn(worker_id, duet_argv(
            "worker", "--role", role, "--worker-id", worker_id, "--host", "127.0.0.1",
            "--kv-cache-memory", self.kv_cache_memory, "--threads", "1", *self._registry_args(),
            *self.worker_args, *extra))

    def start_gateway(self) -> Process:
        return self._spawn("gateway", duet_argv(
            "gateway", "--host", "127.0.0.1", "--port", str(self.port),
            "--router-address", f"127.0.0.1:{self.router_port}", "--redis-url", self.redis_url,
            "--rpc-timeout", "120", *self.gateway_args))

    def start(self, prefill: int = 1, decode: int = 1, both: int = 0) -> "ProcessStack":
        self.start_redis()
        self.start_router()
        for role, count in (("prefill", prefill), ("decode", decode), ("both", both)):
            for i in range(count):
                self.add_worker(role, f"{role}-{i}")
        self.start_gateway()
        return self

    def wait_registered(self, worker_ids: Sequence[str], timeout: float = 240.0) -> None:
        def registered():
            for wid in worker_ids:
                proc = self.procs.get(wid)
                if proc is not None and not proc.alive:
                    raise ProcessExited(f"{wid} exited with {proc.popen.returncode}")
            return set(worker_ids) <= set(self.workers())
        try:
            wait_until(registered, timeout, f"{list(worker_ids)} in the registry", interval=0.25)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{exc}\n{self.report_logs()}") from None

    def wait_ready(self, timeout: float = 240.0) -> "ProcessStack":
        workers = [n for n in self.procs if n not in ("router", "gateway")]
        self.wait_registered(workers, timeout)

        def healthy():
            # a process that exited (a router that could not bind) fails the wait at once
            exited = {n: p.popen.returncode for n, p in self.procs.items() if p.popen is not None and not p.alive}
            if exited:
                raise ProcessExited(f"exited: {exited}")
            return http_status(self.health_url) == 200
        try:
            wait_until(healthy, 120, "the gateway's /health")
        except (TimeoutError, ProcessExited) as exc:
            raise RuntimeError(f"{exc}\n{self.report_logs()}") from None
        return self

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.signal(sig)
        if sig == signal.SIGKILL:
            proc.popen.wait(10)

    def close(self) -> None:
        order = ([p for n, p in self.procs.items() if n == "gateway"]
                 + [p for n, p in self.procs.items() if n not in ("gateway", "router")]
                 + [p for n, p in self.procs.items() if n == "router"])
        for p in order:  # signal all first so the workers drain in parallel
            p.signal(signal.SIGTERM)
        for p in order:
            p.stop(grace_s=20)
        if self._redis is not None:
            self._redis.close()
        self.redis_server.close()


def new_log_dir(name: str) -> Path:
    """A folder of our own for one stack's logs (pytest's tmp dirs are rotated away by
    other sessions' runs on a shared machine)."""
    return Path(tempfile.mkdtemp(prefix=f"duet-{name}-"))


@contextmanager
def managed(request, stack: "_StackBase"):
    """Fixture body: yield the stack, always close it; when a test using it failed, print
    the process logs to the real stderr (past pytest's capture) and keep them, else delete
    them."""
    failed_before = request.session.testsfailed
    try:
        yield stack
    finally:
        try:
            stack.close()
        finally:
            if request.session.testsfailed > failed_before:
                sys.__stderr__.write("\n" + stack.report_logs() + "\n")
                sys.__stderr__.flush()
            else:
                shutil.rmtree(stack.log_dir, ignore_errors=True)


# --- reference outputs ---------------------------------------------------------------------

def model_dir() -> Path:
    from shared.model_files.default_model import resolve_model_dir
    return Path(resolve_model_dir(None))


def page_bytes(model_path: Path, page_size: int, dtype_bytes: int = 4) -> int:
    """Bytes of one KV page from the model's config: layers x (K, V) x kv_heads x page x head_dim."""
    cfg = json.loads((model_path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * kv_heads * page_size * head_dim * dtype_bytes


@dataclass
class Reference:
    token_ids: list[int]
    text: str
    finish_reason: str


def offline_llm(model_path: Path):
    from shared.engine import LLM
    return LLM(str(model_path), kv_cache_memory=64 << 20)


def offline_outputs(llm, prompts: Sequence[Sequence[int]], max_tokens: int,
                    temperature: float = 0.0, seed: int | None = None) -> list[Reference]:
    """What the offline engine (shared.engine.LLM) answers for these token-id prompts."""
    from shared.engine import SamplingParams
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    outs = llm.generate([list(p) for p in prompts], params)
    return [Reference(list(o.token_ids), o.text, o.finish_reason) for o in outs]


def transformers_greedy(model_path: Path, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (stops at EOS like the engine)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=next(iter(eos_ids), 0))
            new = gen[0, ids.shape[1]:].tolist()
            for i, t in enumerate(new):
                if t in eos_ids:
                    new = new[:i + 1]
                    break
            outs.append(new)
    return outs
