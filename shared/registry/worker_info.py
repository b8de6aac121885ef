"""What a worker publishes about itself, and how it is stored in a Redis hash.

Static fields are written at registration; the load fields are rewritten by every
heartbeat. Everything is a string field of one hash (lists as JSON), so any Redis
client (or `redis-cli HGETALL`) can read an entry.
"""
from __future__ import annotations

import json
import re
import secrets
import socket
from dataclasses import asdict, dataclass, field

from shared.perf_model.worker_perf import WorkerPerf
ROLES = ("prefill", "decode", "both")
_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass
class RankKvPool:
    """One TP rank's KV pool as a NIXL peer sees it (see shared.kv_transfer.PoolInfo)."""

    rank: int
    agent_name: str      # NIXL agent name of that rank
    base_addr: int       # address of page 0 in the owning process
    page_bytes: int      # bytes per page (page-major pool: page i = [base + i*page_bytes, +page_bytes))
    num_pages: int
    mem_type: str = "DRAM"  # "DRAM" or "VRAM"
    device_id: int = 0
    blocks: int = 1         # K and V blocks per page (2 x layers)
    num_heads: int = 1      # KV heads this rank holds ...
    first_head: int = 0     # ... starting at this global head


@dataclass
class WorkerLoad:
    """Load a worker reports with every heartbeat (the router's inputs)."""

    free_pages: int = 0
    total_pages: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens waiting for or in prefill
    running_requests: int = 0       # requests in the decode batch (or in prefill, for prefill)
    waiting_requests: int = 0       # admitted but not yet running
    kv_usage: float = 0.0           # share of pages held by live work (duet_kv_cache_usage_ratio)
    decode_context_tokens: int = 0  # positions the decode rows attend to, summed (their step cost)


@dataclass
class WorkerAdapters:
    """The LoRA adapters a worker serves, rewritten with every heartbeat (they load and unload
    at run time): the gateway lists them, the router picks among the workers that serve one,
    preferring those that hold it in a device slot already."""

    served: list[str] = field(default_factory=list)    # every adapter it can run (names)
    resident: list[str] = field(default_factory=list)  # of those, the ones in its device slots now
    runtime: dict[str, str] = field(default_factory=dict)  # of those, loaded at run time: name -> folder
                                                           # (a gateway writes the record back from it)

    def fields(self) -> dict[str, str]:
        return {"lora_adapters": json.dumps(self.served), "lora_resident": json.dumps(self.resident),
                "lora_runtime": json.dumps(self.runtime)}

    @classmethod
    def of(cls, lora) -> "WorkerAdapters":
        """What a worker's LoRA slots (shared/engine/lora/manager.py; None: none) serve now."""
        return cls(lora.names, lora.resident, lora.runtime) if lora is not None else cls()

    @classmethod
    def from_fields(cls, h: dict[str, str]) -> "WorkerAdapters":
        runtime = json.loads(h.get("lora_runtime") or "{}")
        return cls(served=json.loads(h.get("lora_adapters") or "[]"),
                   resident=json.loads(h.get("lora_resident") or "[]"),
                   runtime=runtime if isinstance(runtime, dict) else {})


@dataclass
class WorkerInfo:
    worker_id: str
    role: str                       # prefill | decode | both: what the router places on now
    address: str                    # gRPC host:port
    model: str
    metrics_address: str = ""       # HTTP host:port serving /metrics
    tp: int = 1
    page_size: int = 0
    compat_hash: str = ""           # model + KV layout + dtype (not TP); pairs must match
    kv_layout: str = ""             # the same, readable: L<layers>-H<kv heads>-P<page>-D<head dim>-<dtype>
    checkpoint: str = ""            # fingerprint of the weights and tokenizer (in compat_hash too)
    instance_nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    max_running_requests: int = 0   # decode batch cap (0 = unknown)
    max_batched_tokens: int = 0     # prompt tokens one engine step takes (chunked prefill; 0 = unknown)
    kv_pools: list[RankKvPool] = field(default_factory=list)  # one per rank (NIXL peers)
    # decode: this instance's Ed25519 public key (hex), which verifies the write capabilities
    # it issues with its reservations (shared/kv_transfer/capability.py); "" for other roles
    capability_key: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    perf: WorkerPerf = field(default_factory=WorkerPerf)  # step-time model etc. (shared/perf_model)
    adapters: WorkerAdapters = field(default_factory=WorkerAdapters)  # LoRA adapters it serves
    heartbeat_seq: int = 0          # bumps each heartbeat (no wall clocks across hosts)
    switchable: bool = False        # may change `role` at run time (the planner's SetRole)
    # this process's host boot and PID namespace (ipc_domain.py): workers that share it may map
    # each other's GPU memory over CUDA IPC; "" = unknown (never assumed shared)
    ipc_domain: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not _ID_RE.match(self.worker_id):
            raise ValueError(f"worker_id {self.worker_id!r} must match {_ID_RE.pattern}")

    @property
    def agent_names(self) -> list[str]:
        return [pool.agent_name for pool in sorted(self.kv_pools, key=lambda p: p.rank)]

    def pool(self, rank: int) -> RankKvPool:
        for pool in self.kv_pools:
            if pool.rank == rank:
                return pool
        raise KeyError(f"worker {self.worker_id} publishes no KV pool for rank {rank}")

    # --- Redis hash encoding -------------------------------------------------

    def static_fields(self) -> dict[str, str]:
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "address": self.address,
            "metrics": self.metrics_address,
            "model": self.model,
            "tp": str(self.tp),
            "page_size": str(self.page_size),
            "compat_hash": self.compat_hash,
            "kv_layout": self.kv_layout,
            "checkpoint": self.checkpoint,
            "instance_nonce": self.instance_nonce,
            "max_running_requests": str(self.max_running_requests),
            "max_batched_tokens": str(self.max_batched_tokens),
            "nixl_agents": json.dumps(self.agent_names),
            "kv_pools": json.dumps([asdict(p) for p in self.kv_pools]),
            "capability_key": self.capability_key,
            "switchable": "1" if self.switchable else "0",
            "ipc_domain": self.ipc_domain,
        }

    def load_fields(self) -> dict[str, str]:
        fields = {f"load_{k}": str(v) for k, v in asdict(self.load).items()}
        fields["heartbeat_seq"] = str(self.heartbeat_seq)
        fields.update(self.perf.fields())  # refitted while serving: rewritten with the load
        fields.update(self.adapters.fields())  # loaded and unloaded while serving
        return fields

    def to_hash(self) -> dict[str, str]:
        return {**self.static_fields(), **self.load_fields()}

    @classmethod
    def from_hash(cls, raw: dict) -> "WorkerInfo":
        """Decode HGETALL output (bytes or str keys/values). Raises ValueError/KeyError if malformed."""
        h = {_s(k): _s(v) for k, v in raw.items()}
        load = WorkerLoad(
            free_pages=int(h.get("load_free_pages", 0)),
            total_pages=int(h.get("load_total_pages", 0)),
            queued_prefill_tokens=int(h.get("load_queued_prefill_tokens", 0)),
            running_requests=int(h.get("load_running_requests", 0)),
            waiting_requests=int(h.get("load_waiting_requests", 0)),
            kv_usage=float(h.get("load_kv_usage", 0.0)),
            decode_context_tokens=int(h.get("load_decode_context_tokens", 0)),
        )
        pools = [RankKvPool(**p) for p in json.loads(h.get("kv_pools", "[]"))]
        return cls(
            worker_id=h["worker_id"],
            role=h["role"],
            address=h["address"],
            model=h["model"],
            metrics_address=h.get("metrics", ""),
            tp=int(h.get("tp", 1)),
            page_size=int(h.get("page_size", 0)),
            compat_hash=h.get("compat_hash", ""),
            kv_layout=h.get("kv_layout", ""),
            checkpoint=h.get("checkpoint", ""),
            instance_nonce=h["instance_nonce"],
            max_running_requests=int(h.get("max_running_requests", 0)),
            max_batched_tokens=int(h.get("max_batched_tokens", 0)),
            kv_pools=pools,
            capability_key=h.get("capability_key", ""),
            load=load,
            perf=WorkerPerf.from_fields(h),
            adapters=WorkerAdapters.from_fields(h),
            heartbeat_seq=int(h.get("heartbeat_seq", 0)),
            switchable=h.get("switchable", "0") == "1",
            ipc_domain=h.get("ipc_domain", ""),
        )


def kv_bytes_per_token(worker: WorkerInfo) -> float:
    """KV bytes one token takes in the worker's pool, all ranks (what a handoff moves)."""
    if not worker.kv_pools or worker.page_size <= 0:
        return 0.0
    return sum(p.page_bytes for p in worker.kv_pools) / worker.page_size


def default_worker_id(role: str) -> str:
    """<role>-<hostname>-<random>: unique per process; in k8s the pod name is a better id."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:60]
    return f"{role}-{host}-{secrets.token_hex(3)}"


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
