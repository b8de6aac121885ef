"""`duet up` settings."""
from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class UpConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # gateway HTTP
    prefill: int = 1
    decode: int = 1
    both: int = 0
    redis_url: str | None = None  # None: start a private redis-server
    model: str | None = None
    kv_cache_memory: str | None = None  # per worker, as given; default 512M on CPU, planned on GPU (gpus.py)
    threads: int | None = None  # per worker; default: cores shared among workers
    log_dir: str | None = None
    worker_args: list[str] = field(default_factory=list)
    health_timeout_s: float = 300.0
    # security (services/launcher/security.py): API keys for the gateway, HTTPS, gRPC TLS
    api_keys: list[str] = field(default_factory=list, repr=False)
    api_keys_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    grpc_tls_cert_file: str | None = None
    grpc_tls_key_file: str | None = None
    grpc_tls_ca_file: str | None = None
    prefill_tp: int | None = None  # per-role TP (None: the workers' --tp / DUET_TP)
    decode_tp: int | None = None

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.both

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None) -> "UpConfig":
        e = os.environ.get
        p = argparse.ArgumentParser(
            prog="duet up",
            description="Start the whole Duet stack as local processes: redis (unless --redis-url), "
                        "router, prefill and decode workers, and the OpenAI-compatible gateway.")
        p.add_argument("--host", default=e("DUET_HOST", "127.0.0.1"), help="address every service binds")
        p.add_argument("--port", type=int, default=int(e("DUET_PORT", "8000")), help="gateway HTTP port")
        p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
        p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
        p.add_argument("--both", type=int, default=0,
                       help="colocated workers serving whole requests (e.g. --both 1 --prefill 0 --decode 0)")
        p.add_argument("--redis-url", default=e("DUET_REDIS_URL"), help="use this Redis instead of starting one")
        p.add_argument("--model", default=e("DUET_MODEL"), help="HF model folder (default: embedded SmolLM2-135M)")
        p.add_argument("--kv-cache-memory", default=e("DUET_KV_CACHE_MEMORY"),
                       help="KV budget per worker (default: 512M on CPU, absolute so several workers fit; "
                            "on GPUs --mem-fraction of a worker's own GPUs, or a share of a shared one)")
        p.add_argument("--threads", type=int, default=None,
                       help="torch threads per worker (default: the machine's cores shared among workers)")
        p.add_argument("--log-dir", default=None, help="where each process writes its log")
        p.add_argument("--health-timeout", type=float, default=300.0)
        s = p.add_argument_group("security")
        s.add_argument("--api-key", action="append", default=None,
                       help="require this API key (Authorization: Bearer KEY) at the gateway; repeatable. "
                            "The gateway gets it in a private 0600 file, not on its command line; this "
                            "process's own argv is visible in `ps`, so prefer env DUET_API_KEYS")
        s.add_argument("--api-keys-file", default=e("DUET_API_KEYS_FILE"),
                       help="file with one API key per line (env DUET_API_KEYS_FILE)")
        s.add_argument("--tls-cert-file", default=e("DUET_TLS_CERT_FILE"), help="gateway HTTPS certificate (PEM)")
        s.add_argument("--tls-key-file", default=e("DUET_TLS_KEY_FILE"), help="gateway HTTPS key (PEM)")
        s.add_argument("--grpc-tls-cert-file", default=e("DUET_GRPC_TLS_CERT_FILE"),
                       help="gRPC certificate (PEM) for the router and workers, and the gateway's client "
                            "certificate under mTLS (one certificate for every service)")
        s.add_argument("--grpc-tls-key-file", default=e("DUET_GRPC_TLS_KEY_FILE"), help="its key (PEM)")
        s.add_argument("--grpc-tls-ca-file", default=e("DUET_GRPC_TLS_CA_FILE"),
                       help="CA of the gRPC certificates: with it every gRPC link is mutual TLS")
        p.add_argument("--prefill-tp", type=int, default=None,
                       help="tensor-parallel size of the prefill workers (default: --tp after --, else 1); "
                            "may differ from --decode-tp: KV is re-sharded by heads on the way")
        p.add_argument("--decode-tp", type=int, default=None, help="tensor-parallel size of the decode workers")
        p.add_argument("worker_args", nargs=argparse.REMAINDER,
                       help="after --, extra flags passed to every worker (e.g. -- --page-size 32)")
        a = p.parse_args(argv)
        if min(a.prefill, a.decode, a.both) < 0:
            p.error("worker counts must be >= 0")
        if a.both == 0 and (a.prefill == 0 or a.decode == 0):
            p.error("need at least one prefill and one decode worker, or --both N")
        if any(t is not None and t < 1 for t in (a.prefill_tp, a.decode_tp)):
            p.error("--prefill-tp and --decode-tp must be >= 1")
        extra = [x for x in a.worker_args if x != "--"]
        if bool(a.tls_cert_file) != bool(a.tls_key_file):
            p.error("--tls-cert-file and --tls-key-file go together")
        if bool(a.grpc_tls_cert_file) != bool(a.grpc_tls_key_file):
            p.error("--grpc-tls-cert-file and --grpc-tls-key-file go together")
        if a.grpc_tls_ca_file and not a.grpc_tls_cert_file:
            p.error("--grpc-tls-ca-file needs --grpc-tls-cert-file and --grpc-tls-key-file")
        keys = (e("DUET_API_KEYS") or "").replace(",", " ").split() + list(a.api_key or [])
        return cls(host=a.host, port=a.port, prefill=a.prefill, decode=a.decode, both=a.both,
                   redis_url=a.redis_url, model=a.model, kv_cache_memory=a.kv_cache_memory,
                   threads=a.threads, log_dir=a.log_dir, worker_args=extra, health_timeout_s=a.health_timeout,
                   api_keys=keys, api_keys_file=a.api_keys_file, tls_cert_file=a.tls_cert_file,
                   tls_key_file=a.tls_key_file, grpc_tls_cert_file=a.grpc_tls_cert_file,
                   grpc_tls_key_file=a.grpc_tls_key_file, grpc_tls_ca_file=a.grpc_tls_ca_file,
                   prefill_tp=a.prefill_tp, decode_tp=a.decode_tp)

    def role_tp(self, role: str, default: int) -> int:
        return {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role) or default

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert_file else "http"
