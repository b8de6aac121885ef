"""Runs probes one at a time, each from an idle stack, each bounded, each watched."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from loadtest.hostile.client import Server
from loadtest.hostile.config import SuiteConfig
from loadtest.hostile.context import ProbeContext
from loadtest.hostile.kv_metrics import KvWatch, decode_metrics_from_registry
from loadtest.hostile.monitors import GatewayProcess, HealthSampler, RssWatch
from loadtest.hostile.probe import Probe
from loadtest.hostile.result import FAIL, PASS, UNCLEAR, ProbeResult

SETTLED_HEALTH_S = 0.5  # /health this fast (a loaded 2-core box is slow at times) ...
SETTLED_CPU_SHARE = 0.3  # ... and the gateway using less than this share of a core: idle


async def settle(ctx: ProbeContext, timeout_s: float) -> tuple[float, str | None]:
    """Wait until /health is fast, the gateway's CPU is quiet and the decode KV is 0 (what can
    be read of these); (seconds waited, None or what was still busy at the deadline)."""
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=ctx.server.base_url, timeout=5, verify=False) as http:
        while True:
            busy = []
            t0 = time.monotonic()
            try:
                status = (await http.get("/health")).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            took = time.monotonic() - t0
            if status != 200 or took > SETTLED_HEALTH_S:
                busy.append(f"/health {status} in {took * 1000:.0f} ms")
            if ctx.gateway is not None:
                c0 = ctx.gateway.cpu_s()
                await asyncio.sleep(0.3)
                c1 = ctx.gateway.cpu_s()
                if c0 is not None and c1 is not None and (c1 - c0) / 0.3 > SETTLED_CPU_SHARE:
                    busy.append(f"gateway CPU {(c1 - c0) / 0.3:.0%}")
            if ctx.kv is not None and ctx.kv.addresses:
                usage = await ctx.kv.usage(http)
                if usage:
                    busy.append(f"decode KV {usage:.3f}")
            waited = time.monotonic() - started
            if not busy:
                return waited, None
            if waited > timeout_s:
                return waited, ", ".join(busy)
            await asyncio.sleep(0.2)


async def run_probe(probe: Probe, ctx: ProbeContext) -> ProbeResult:
    r = ProbeResult(probe.name, probe.item, probe.expect)
    r.settle_s, busy = await settle(ctx, ctx.sizes.settle_timeout_s)
    if busy:
        r.details["not_settled"] = f"still busy after {r.settle_s:.0f} s: {busy}"
    ctx.abort = asyncio.Event()
    loop = asyncio.get_running_loop()
    capped: dict[str, float] = {}

    def on_cap(growth_mb: float) -> None:
        capped["mb"] = growth_mb
        loop.call_soon_threadsafe(ctx.abort.set)

    timeout_s = probe.timeout_s or ctx.sizes.probe_timeout_s
    cpu_before = ctx.gateway.cpu_s() if ctx.gateway else None
    rss = RssWatch(ctx.gateway, ctx.sizes.rss_cap_mb, on_cap)
    health = HealthSampler(ctx.server.base_url)
    started = time.monotonic()
    error = None
    with health, rss:
        task = asyncio.create_task(probe.run(ctx, r))
        aborted = asyncio.create_task(ctx.abort.wait())
        done, _ = await asyncio.wait({task, aborted}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            r.aborted = (f"gateway RSS grew {capped['mb']:.0f} MB, past the {ctx.sizes.rss_cap_mb:.0f} MB cap"
                         if aborted in done else f"timeout after {timeout_s:.0f} s")
            if r.status is None:
                r.status = "aborted" if aborted in done else "timeout"
        aborted.cancel()
        outcome = (await asyncio.gather(task, aborted, return_exceptions=True))[0]
        if isinstance(outcome, Exception):
            error = f"{type(outcome).__name__}: {outcome}"
        r.duration_s = time.monotonic() - started
    await asyncio.sleep(0.3)  # what the gateway keeps, not what it frees at once
    if ctx.gateway is not None:
        r.rss_before_mb, r.rss_peak_mb, r.rss_after_mb = rss.before, rss.peak, ctx.gateway.rss_mb()
        cpu_after = ctx.gateway.cpu_s()
        if cpu_before is not None and cpu_after is not None:
            r.gateway_cpu_s = cpu_after - cpu_before
    s = health.stats
    r.health_samples, r.health_p50_ms, r.health_max_ms, r.health_errors = s.samples, s.p50_ms, s.max_ms, s.errors
    if error is not None:
        r.verdict, r.reason = UNCLEAR, f"the probe itself failed: {error}"
        return r
    ok, why = probe.judge(r)
    r.verdict = PASS if ok else UNCLEAR if ok is None else FAIL
    r.reason = why
    return r


def select(probes: list[Probe], only: list[str], skip: list[str]) -> list[Probe]:
    chosen = [p for p in probes if not only or any(p.matches(s) for s in only)]
    return [p for p in chosen if not any(p.matches(s) for s in skip)]


def redis_url_of(gateway: GatewayProcess | None) -> str | None:
    """The --redis-url the gateway was started with (duet up passes it on the command line),
    with the password from the file its environment names (duet up's default: ours to read
    when the gateway is our own process)."""
    argv = gateway.cmdline() if gateway else []
    url = None
    for i, arg in enumerate(argv):
        if arg == "--redis-url" and i + 1 < len(argv):
            url = argv[i + 1]
        elif arg.startswith("--redis-url="):
            url = arg.split("=", 1)[1]
    password_file = gateway.environ().get("DUET_REDIS_PASSWORD_FILE") if gateway and url else None
    if url and password_file and "@" not in url:
        try:
            url = url.replace("redis://", f"redis://:{Path(password_file).read_text().strip()}@", 1)
        except OSError:
            pass  # not ours to read: the registry reading fails and says so
    return url


def gateway_pid_listening_on(port: int) -> int | None:
    import psutil
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


async def build_context(cfg: SuiteConfig, log: Callable[[str], None]) -> ProbeContext:
    server = Server(cfg.base_url.rstrip("/").removesuffix("/v1"), cfg.api_key)
    async with server.client(10) as http:
        r = await http.get("/v1/models")
        if r.status_code != 200:
            raise RuntimeError(f"GET /v1/models answered {r.status_code}: {r.text[:200]} (an API key needed?)")
        server.model = r.json()["data"][0]["id"]
    pid = cfg.gateway_pid
    if pid == 0:  # "auto"
        pid = gateway_pid_listening_on(server.host_port[1])
        log(f"gateway pid: {pid if pid else 'not found (RSS not measured)'}")
    gateway = GatewayProcess(pid) if pid else None
    addresses = list(cfg.worker_metrics)
    redis_url = cfg.redis_url or redis_url_of(gateway)
    if not addresses and redis_url:
        try:
            addresses = decode_metrics_from_registry(redis_url)
        except Exception as exc:  # unreachable, auth: the KV readings are skipped, not the suite
            log(f"registry {redis_url}: {type(exc).__name__}: {exc}")
    log(f"model {server.model}; decode /metrics: {', '.join(addresses) or 'none (KV not measured)'}")
    return ProbeContext(server, cfg.sizes, gateway, KvWatch(addresses) if addresses else None)


async def run_suite(cfg: SuiteConfig, probes: list[Probe], log: Callable[[str], None] = print) -> list[ProbeResult]:
    ctx = await build_context(cfg, log)
    results = []
    for probe in probes:
        r = await run_probe(probe, ctx)
        results.append(r)
        log(f"{r.verdict:7} {r.name:40} {str(r.status):>14} {r.duration_s:5.1f}s  {r.reason}")
    return results

