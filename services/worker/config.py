"""Worker settings (prefill, decode or both), from CLI flags and DUET_* environment."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shared.registry.config import RegistryConfig
from shared.security.grpc_tls import GrpcTlsConfig

ROLES = ("prefill", "decode", "both")


@dataclass
class WorkerConfig:
    role: str = "both"
    host: str = "127.0.0.1"  # bind address
    advertise_host: str = ""  # address others dial (registry); default: host, or 127.0.0.1 for 0.0.0.0
    port: int = 0  # gRPC; 0 = pick a free port
    metrics_port: int = 0
    worker_id: str = ""
    model: str | None = None
    served_model_name: str = ""
    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 16
    kv_cache_memory: int | None = None
    mem_fraction: float = 0.85
    max_num_batched_tokens: int | None = None
    max_running_requests: int = 256
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"
    cuda_graph: bool = True
    overlap_schedule: bool | None = None  # None: the engine's default (off with TP on GPUs)
    tp: int = 1
    warmup: bool = True  # run every kernel variant once before registering (shared/engine/warmup.py)
    load_format: str = "auto"  # auto: the folder's safetensors | dummy: seeded random weights (benchmarks)
    ep: int = 1  # MoE: 1 (experts sliced over the TP ranks) or --tp (experts split whole)
    threads: int | None = None
    reserve_timeout_s: float = 10.0  # decode: bounded admission wait
    notice_timeout_s: float = 30.0  # decode: wait for prefill's KV before recomputing
    write_timeout_s: float = 20.0  # prefill: a KV write slower than this has failed
    recompute_on_missing_kv: bool = True
    nixl_progress_thread: bool = False  # NIXL's thread spins a core; the engine loop polls instead
    log_level: str = "info"
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    tls: GrpcTlsConfig = field(default_factory=GrpcTlsConfig)  # gRPC server TLS / mTLS

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> "WorkerConfig":
        env = os.environ if env is None else env
        p = argparse.ArgumentParser(prog="duet worker", description="A Duet prefill/decode worker")
        e = env.get
        p.add_argument("--role", choices=ROLES, default=e("DUET_ROLE", "both"))
        p.add_argument("--host", default=e("DUET_HOST", "127.0.0.1"))
        p.add_argument("--advertise-host", default=e("DUET_ADVERTISE_HOST", ""),
                       help="address other services dial (default: --host, or 127.0.0.1 if 0.0.0.0)")
        p.add_argument("--port", type=int, default=int(e("DUET_PORT", "0")))
        p.add_argument("--metrics-port", type=int, default=int(e("DUET_METRICS_PORT", "0")))
        p.add_argument("--worker-id", default=e("DUET_WORKER_ID", ""))
        p.add_argument("--model", default=e("DUET_MODEL"), help="HF model folder (default: embedded SmolLM2-135M)")
        p.add_argument("--served-model-name", default=e("DUET_SERVED_MODEL_NAME", ""))
        p.add_argument("--dtype", default=e("DUET_DTYPE", "auto"), choices=["auto", "float32", "bfloat16", "float16"])
        p.add_argument("--device", default=e("DUET_DEVICE", "auto"))
        p.add_argument("--page-size", type=int, default=int(e("DUET_PAGE_SIZE", "16")))
        p.add_argument("--kv-cache-memory", type=_size, default=_size(e("DUET_KV_CACHE_MEMORY", "0")) or None,
                       help="KV budget, e.g. 512M or 4G (default: 1G on CPU, --mem-fraction on GPU)")
        p.add_argument("--mem-fraction", type=float, default=float(e("DUET_MEM_FRACTION", "0.85")))
        p.add_argument("--max-num-batched-tokens", type=int, default=int(e("DUET_MAX_BATCHED_TOKENS", "0")) or None)
        p.add_argument("--max-running-requests", type=int, default=int(e("DUET_MAX_RUNNING", "256")))
        p.add_argument("--max-model-len", type=int, default=int(e("DUET_MAX_MODEL_LEN", "0")) or None)
        p.add_argument("--disable-prefix-cache", action="store_true")
        p.add_argument("--attention-backend", default=e("DUET_ATTENTION_BACKEND", "auto"))
        p.add_argument("--disable-cuda-graph", action="store_true")
        p.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction,
                       default=_optional_flag(e("DUET_OVERLAP_SCHEDULE")),
                       help="prepare step N+1 on the CPU while the device runs step N (default on, "
                            "except with --tp > 1 on GPUs, where it measured slower; "
                            "--no-overlap-schedule or DUET_OVERLAP_SCHEDULE=0 for the plain loop)")
        p.add_argument("--tp", type=int, default=int(e("DUET_TP", "1")))
        p.add_argument("--warmup", action=argparse.BooleanOptionalAction,
                       default=e("DUET_WARMUP", "1").lower() not in ("0", "false", "no"),
                       help="before registering, push requests of every shape bucket through the engine "
                            "(compiles, graph pools, allocator) so the first real request is as fast as later "
                            "ones (default on)")
        p.add_argument("--load-format", choices=("auto", "dummy"), default=e("DUET_LOAD_FORMAT", "auto"),
                       help="dummy: random weights drawn on the device from a fixed seed instead of the "
                            "folder's safetensors (benchmarks of real shapes; every worker of one TP size "
                            "and device type draws the same weights)")
        p.add_argument("--ep", type=int, default=int(e("DUET_EP", "1")),
                       help="MoE models: expert-parallel size, 1 or --tp (each rank holds 1/ep of the "
                            "experts whole instead of a slice of every expert)")
        p.add_argument("--threads", type=int, default=int(e("DUET_THREADS", "0")) or None,
                       help="torch intra-op threads (CPU)")
        p.add_argument("--reserve-timeout", type=float, default=float(e("DUET_RESERVE_TIMEOUT", "10")))
        p.add_argument("--notice-timeout", type=float, default=float(e("DUET_NOTICE_TIMEOUT", "30")))
        p.add_argument("--write-timeout", type=float, default=float(e("DUET_WRITE_TIMEOUT", "20")))
        p.add_argument("--no-recompute", action="store_true",
                       help="decode fails a request whose KV never arrives instead of recomputing it")
        p.add_argument("--nixl-progress-thread", action="store_true",
                       default=e("DUET_NIXL_PROGRESS_THREAD", "") not in ("", "0", "false"),
                       help="run NIXL's UCX progress thread (it busy-spins a core; off: the engine "
                            "loop progresses transfers while any is in flight)")
        p.add_argument("--log-level", default=e("DUET_LOG_LEVEL", "info"))
        RegistryConfig.add_args(p, env)
        GrpcTlsConfig.add_args(p, env)
        a = p.parse_args(argv)
        return cls(role=a.role, host=a.host, advertise_host=a.advertise_host, port=a.port,
                   metrics_port=a.metrics_port, worker_id=a.worker_id, model=a.model,
                   served_model_name=a.served_model_name, dtype=a.dtype, device=a.device,
                   page_size=a.page_size, kv_cache_memory=a.kv_cache_memory, mem_fraction=a.mem_fraction,
                   max_num_batched_tokens=a.max_num_batched_tokens, max_running_requests=a.max_running_requests,
                   max_model_len=a.max_model_len, enable_prefix_cache=not a.disable_prefix_cache,
                   attention_backend=a.attention_backend, cuda_graph=not a.disable_cuda_graph,
                   overlap_schedule=a.overlap_schedule, tp=a.tp, ep=a.ep, load_format=a.load_format, warmup=a.warmup,
                   threads=a.threads, reserve_timeout_s=a.reserve_timeout, notice_timeout_s=a.notice_timeout,
                   write_timeout_s=a.write_timeout, recompute_on_missing_kv=not a.no_recompute,
                   nixl_progress_thread=a.nixl_progress_thread,
                   log_level=a.log_level, registry=RegistryConfig.from_args(a), tls=GrpcTlsConfig.from_args(a))

    @property
    def dial_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host


def _size(text: str) -> int:
    """'512M' / '4G' / '1048576' -> bytes."""
    text = str(text).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text or 0)


def _optional_flag(value: str | None) -> bool | None:
    """An on/off env value, or None when unset (the component's own default)."""
    if value is None or value == "":
        return None
    return value.lower() not in ("0", "false", "no", "off")
