"""`duet up` settings: flags with DUET_* environment defaults, each declared once
(shared/settings); the variables it shares with the services (DUET_HOST, DUET_MODEL, ...) mean
the same for the whole stack."""
from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shared.perf_model.config import ItlTarget, TtftTarget
from shared.settings import parsers
from shared.settings.drain import drain_grace
from shared.settings.flags import add_flags, from_args
from shared.settings.spec import nested, setting


@dataclass
class UpConfig:
    host: str = setting("127.0.0.1", flag="--host", env="DUET_HOST", help="address every service binds")
    port: int = setting(8000, flag="--port", env="DUET_PORT", help="gateway HTTP port")
    prefill: int = setting(1, flag="--prefill", help="prefill workers (with the planner on: to start with)")
    decode: int = setting(1, flag="--decode", help="decode workers (with the planner on: to start with)")
    both: int = setting(0, flag="--both",
                        help="colocated workers serving whole requests (e.g. --both 1 --prefill 0 --decode 0)")
    planner: str = setting(
        "on", flag="--planner", env="DUET_PLANNER", choices=("on", "off"),
        help="on: every worker is started switchable (worker-0, worker-1, ...) in the roles the counts above "
             "give, and `duet planner` switches their roles as the load asks (TTFT and ITL against "
             "--slo-ttft-ms / --slo-itl-ms); off: the workers keep the roles they started with (prefill-0, "
             "decode-0, ...)")
    placement_overflow: str = setting(
        "auto", flag="--placement-overflow", env="DUET_UP_PLACEMENT_OVERFLOW", choices=("auto", "on", "off"),
        help="the router's overflow placement (a decode worker also prefills long prompts while the prefill "
             "workers are past the first-token target and its rows keep the inter-token target); auto: on "
             "with the planner (measured on two H200s: 4096-token prompts at 12 req/s, goodput 59% -> 76%, "
             "docs/performance/serving.md), off with fixed roles, which stay as configured for comparison; "
             "auto leaves a DUET_PLACEMENT_OVERFLOW in the environment to the router")
    ttft: TtftTarget = nested(TtftTarget)
    slo: ItlTarget = nested(ItlTarget)
    redis_url: str | None = setting(flag="--redis-url", env="DUET_REDIS_URL",
                                    help="use this Redis instead of starting one")
    # several models: one pool each (the counts above apply per model) behind one router and gateway
    models: list[str] = setting(
        flag="--model", env="DUET_MODEL", repeat=True, parse=parsers.one_item,
        help="HF model folder (default: embedded SmolLM2-135M); repeatable: each model gets its own workers "
             "(--prefill/--decode/--both apply per model, and with the planner on a planner of its own), all "
             "behind one router and gateway, served under the folder's name; the first is the default model. "
             "DUET_MODEL counts as the first --model")
    # per worker, as given (passed on); default 512M on CPU, planned on GPU (gpus.py)
    kv_cache_memory: str | None = setting(
        flag="--kv-cache-memory", env="DUET_KV_CACHE_MEMORY", parse=parsers.size_text,
        help="KV budget per worker (default: 512M on CPU, absolute so several workers fit; on GPUs "
             "--mem-fraction of a worker's own GPUs, or a share of a shared one)")
    threads: int | None = setting(flag="--threads", parse=parsers.optional_int,
                                  help="torch threads per worker (default: the machine's cores shared among workers)")
    gateway_processes: int = setting(
        0, flag="--gateway-processes", env="DUET_GATEWAY_PROCESSES",
        help="gateway processes sharing the API port (SO_REUSEPORT: the kernel spreads connections over "
             "them); one frames about 12k streamed tokens a second (~80 us of CPU each), about what one "
             "8B worker on an H200 makes at saturation. 0 = one per GPU in use (GPUs, at most one per "
             "worker), at most a quarter of the cores (1 on CPU). With more than one, each serves /metrics "
             "on a port of its own (the banner lists them; the planner reads them all) and admits its "
             "share of the workers (--gateways)")
    chat_template_processes: int | None = setting(
        flag="--chat-template-processes", env="DUET_CHAT_TEMPLATE_PROCESSES", parse=parsers.optional_int,
        help="the gateway's chat-template helper processes (default: half the machine's cores, 2 to 8; each "
             "renders and tokenizes one request's whole conversation at a time)")
    log_dir: str | None = setting(flag="--log-dir", help="where each process writes its log (default: a new temp dir)")
    worker_args: list[str] = field(default_factory=list)  # after `--`, passed to every worker
    health_timeout_s: float = setting(300.0, flag="--health-timeout",
                                      help="seconds to wait for every worker to report ready and the gateway to become healthy")
    # supervision (services/launcher/restart_policy.py, shutdown.py)
    restart_limit: int = setting(
        5, flag="--restart-limit", env="DUET_RESTART_LIMIT",
        help="restarts in a row of one child (worker, gateway, router, redis) before duet up gives up and "
             "stops with exit code 1 (a worker of a stack that has served, while another worker runs: left "
             "down and tried again every --restart-retry); 0: never restart")
    restart_backoff_s: float = setting(
        1.0, flag="--restart-backoff", env="DUET_RESTART_BACKOFF",
        help="seconds before a dead child's first restart; doubles with each death in a row, up to 30")
    restart_reset_s: float = setting(
        60.0, flag="--restart-reset", env="DUET_RESTART_RESET",
        help="seconds a child must run for its earlier deaths to be forgiven (a new row starts)")
    restart_retry_s: float = setting(
        300.0, flag="--restart-retry", env="DUET_RESTART_RETRY",
        help="seconds between tries of a worker that died --restart-limit times in a row once the stack has "
             "served, while another worker runs (it is left down, not the stack stopped)")
    drain_grace_s: float = drain_grace()  # shared with the worker and gateway it passes it to
    # security (services/launcher/security.py): API keys for the gateway, HTTPS, gRPC TLS
    api_keys: list[str] = setting(
        flag="--api-key", env="DUET_API_KEYS", repeat=True, secret=True,
        help="require this API key (Authorization: Bearer KEY) at the gateway; repeatable. The gateway gets "
             "it in a private 0600 file, not on its command line; this process's own argv is visible in `ps`, "
             "so prefer env DUET_API_KEYS")
    api_keys_file: str | None = setting(flag="--api-keys-file", env="DUET_API_KEYS_FILE",
                                        help="file with one API key per line")
    tls_cert_file: str | None = setting(flag="--tls-cert-file", env="DUET_TLS_CERT_FILE",
                                        help="gateway HTTPS certificate (PEM)")
    tls_key_file: str | None = setting(flag="--tls-key-file", env="DUET_TLS_KEY_FILE", help="gateway HTTPS key (PEM)")
    insecure: bool = setting(
        False, flag="--insecure", env="DUET_INSECURE",
        help="open the local stack to every local process: plaintext gRPC that any caller may use, and "
             "a Redis without a password (default: a throwaway CA issues each service a certificate "
             "naming its role for mutual TLS on every gRPC link, and the Redis duet up starts gets a "
             "random password; both in 0600 files, removed when it stops)")
    prefill_tp: int | None = setting(
        flag="--prefill-tp", parse=int,
        help="tensor-parallel size of the prefill workers (default: --tp after --, else 1); may differ from "
             "--decode-tp: KV is re-sharded by heads on the way")
    decode_tp: int | None = setting(flag="--decode-tp", parse=int, help="tensor-parallel size of the decode workers")
    # LoRA: the workers take --lora / --max-loras after `--`; the gateway's run-time endpoints are this
    enable_lora_loading: bool = setting(
        False, flag="--enable-lora-loading", env="DUET_ENABLE_LORA_LOADING",
        help="the gateway serves POST /v1/load_lora_adapter and /v1/unload_lora_adapter (the workers read the "
             "folder; give them slots with `-- --max-loras N`)")

    @property
    def workers_per_model(self) -> int:
        return self.prefill + self.decode + self.both

    @property
    def num_workers(self) -> int:
        return self.workers_per_model * max(1, len(self.models))

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> "UpConfig":
        p = argparse.ArgumentParser(
            prog="duet up",
            description="Start the whole Duet stack as local processes: redis (unless --redis-url), "
                        "router, prefill and decode workers, and the OpenAI-compatible gateway.")
        add_flags(p, cls, env)
        p.add_argument("worker_args", nargs=argparse.REMAINDER,
                       help="after --, extra flags passed to every worker (e.g. -- --page-size 32)")
        a = p.parse_args(argv)
        cfg = from_args(cls, a)
        if min(cfg.prefill, cfg.decode, cfg.both) < 0:
            p.error("worker counts must be >= 0")
        if cfg.both == 0 and (cfg.prefill == 0 or cfg.decode == 0):
            p.error("need at least one prefill and one decode worker, or --both N")
        if any(t is not None and t < 1 for t in (cfg.prefill_tp, cfg.decode_tp)):
            p.error("--prefill-tp and --decode-tp must be >= 1")
        if cfg.gateway_processes < 0:
            p.error("--gateway-processes must be >= 0 (0: one per GPU in use)")
        if bool(cfg.tls_cert_file) != bool(cfg.tls_key_file):
            p.error("--tls-cert-file and --tls-key-file go together")
        if (cfg.restart_limit < 0 or cfg.restart_backoff_s < 0 or cfg.restart_reset_s < 0 or cfg.drain_grace_s < 0
                or cfg.restart_retry_s < 0):
            p.error("--restart-limit, --restart-backoff, --restart-reset, --restart-retry and --drain-grace must be >= 0")
        cfg.worker_args = [x for x in a.worker_args if x != "--"]
        if len(cfg.models) > 1 and any(x == "--served-model-name" or x.startswith("--served-model-name=")
                                       for x in cfg.worker_args):
            p.error("with several --model, each is served under its folder's name: drop --served-model-name")
        return cfg

    @property
    def switchable(self) -> bool:
        """Workers started able to take any role (the planner moves them)."""
        return self.planner == "on"

    def worker_names(self, model_index: int = 0) -> list[tuple[str, str]]:
        """(role, name) of every worker duet up starts for one model: prefill-0.., decode-0..,
        both-0..; with the planner on, worker-0.. in those roles (its role changes, its name
        stays); the name is its registry id. The second model's names start `m1-`, and so on."""
        roles = [role for role, count in (("prefill", self.prefill), ("decode", self.decode), ("both", self.both))
                 for _ in range(count)]
        prefix = f"m{model_index}-" if model_index else ""
        if self.switchable:
            return [(role, f"{prefix}worker-{i}") for i, role in enumerate(roles)]
        return [(role, f"{prefix}{role}-{roles[:i].count(role)}") for i, role in enumerate(roles)]

    def role_tp(self, role: str, default: int) -> int:
        return {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role) or default

    def overflow_flags(self, env: Mapping[str, str]) -> list[str]:
        """The router's overflow flag: --placement-overflow on or off as given; auto: on with the
        planner, unless the environment the router inherits sets DUET_PLACEMENT_OVERFLOW (its own)."""
        if self.placement_overflow != "auto":
            return ["--placement-overflow" if self.placement_overflow == "on" else "--no-placement-overflow"]
        return ["--placement-overflow"] if self.switchable and "DUET_PLACEMENT_OVERFLOW" not in env else []

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert_file else "http"


def auto_gateway_processes(gpus_in_use: int, cores: int) -> int:
    """--gateway-processes 0: one gateway process per GPU in use (the GPUs, at most one per
    worker: workers sharing one stream one GPU's worth), since one process frames about what one
    worker streams at saturation (~80 us of CPU a token, docs/performance/serving.md); at most a
    quarter of the cores; one on CPU, whose workers stream far less."""
    return max(1, min(gpus_in_use, cores // 4))
