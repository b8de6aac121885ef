"""Which GPUs each `duet up` worker gets, and how its KV cache is sized there.

With enough GPUs every worker gets its own block of `tp` of them (through
CUDA_VISIBLE_DEVICES, so the worker's cuda:0..tp-1 are its block) and sizes its KV
cache from --mem-fraction, as a pod does. With fewer, workers share GPUs round-robin and
each gets an absolute KV budget that fits beside the others, because a fraction of the
card sized at start-up would let the first worker take the room the next one needs.
On a CPU-only host, or with --device cpu for the workers, nothing changes."""
from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.engine.config import EngineConfig
from shared.settings.flags import env_value

SHARED_FRACTION = 0.80  # of a shared card's memory, split among the workers on it
# How a shared card's KV room and the host's pinned host-tier memory are divided: decode
# (and colocated) workers hold conversations between turns and serve later turns themselves
# (local prefill), a prefill worker's cache mostly repeats what decode keeps
ROLE_WEIGHTS = {"prefill": 1, "decode": 2, "both": 2}
HOST_TIER_FRACTION = 0.5  # of the host's available memory, pinned for the workers' host KV tiers


@dataclass(frozen=True)
class WorkerFlags:
    """The worker flags (passed after `--`) that placement depends on."""

    tp: int = 1
    device: str = "auto"
    kv_cache_memory: str | None = None
    kv_host_memory: str | None = None

    @classmethod
    def parse(cls, worker_args: Sequence[str]) -> "WorkerFlags":
        p = argparse.ArgumentParser(add_help=False)  # the workers' own defaults: their DUET_TP, DUET_DEVICE
        p.add_argument("--tp", type=int, default=env_value(EngineConfig, "tp_size"))
        p.add_argument("--device", default=env_value(EngineConfig, "device"))
        p.add_argument("--kv-cache-memory", default=None)
        p.add_argument("--kv-host-memory", default=None)
        a, _ = p.parse_known_args(list(worker_args))
        return cls(tp=a.tp, device=a.device, kv_cache_memory=a.kv_cache_memory, kv_host_memory=a.kv_host_memory)


@dataclass(frozen=True)
class Placement:
    gpus: tuple[str | int, ...]     # CUDA_VISIBLE_DEVICES entries (indices or UUIDs); () = CPU
    kv_cache_memory: str | None     # None: the worker sizes from --mem-fraction
    shared: bool = False            # another worker uses one of these GPUs too
    kv_host_memory: str | None = None  # None: the worker's own default (none on CPU)

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus))} if self.gpus else {}


# Present wherever a CUDA (or ROCm) device can be: the driver's proc entry and device nodes (a
# container gets /dev/nvidiactl from the device plugin).
_GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices or
    UUIDs), so a worker's narrower list stays inside what `duet up` was given."""
    if not any(os.path.exists(p) for p in _GPU_DRIVER_PATHS):
        return []  # no GPU driver on this host: importing torch to say so costs a second of CPU
    try:
        import torch
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install means no GPUs for us
        return []
    listed = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return listed[:count] if len(listed) >= count else [str(i) for i in range(count)]


def host_available_bytes() -> int:
    """MemAvailable of this host (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gpu_memory_bytes() -> int:
    import torch
    return torch.cuda.get_device_properties(0).total_memory


def weight_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint on disk: an upper bound of bf16 weights loaded from a bf16 or
    fp32 file. A folder without weights (workers started with --load-format dummy): the bf16
    size its config.json describes."""
    on_disk = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return on_disk or 2 * config_param_count(Path(model_dir) / "config.json")


def config_param_count(config_path: Path) -> int:
    """Parameters of a Llama/Qwen-family model (dense or MoE) from its config.json (0 if unreadable)."""
    import json
    try:
        c = json.loads(config_path.read_text())
        h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    except (OSError, ValueError, KeyError):
        return 0
    kv = c.get("num_key_value_heads") or heads
    d = c.get("head_dim") or h // heads
    attn = h * d * (heads + 2 * kv) + heads * d * h
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    if experts:
        inter = c.get("moe_intermediate_size") or c["intermediate_size"]
        mlp = experts * 3 * h * inter + h * experts + 3 * h * (c.get("shared_expert_intermediate_size") or 0)
    else:
        mlp = 3 * h * c.get("intermediate_size", 4 * h)
    embed = c.get("vocab_size", 0) * h * (1 if c.get("tie_word_embeddings") else 2)
    return embed + layers * (attn + mlp)


def plan(num_workers: int, flags: WorkerFlags, gpus: Sequence[str | int], explicit_kv: str | None = None,
         cpu_kv: str = "512M", card_bytes: int = 0, model_bytes: int = 0,
         tps: Sequence[int] | None = None, roles: Sequence[str] | None = None,
         host_bytes: int = 0) -> list[Placement]:
    """One Placement per worker, in start order. explicit_kv: a KV budget the user gave
    (`duet up --kv-cache-memory` or the worker flag), used as is everywhere; cpu_kv: the
    per-worker default on CPU (absolute, so several workers fit in host memory).
    tps: each worker's TP size (default flags.tp for all; prefill and decode may differ).

    Each worker takes the next `tp` GPUs in order, wrapping to the first GPU when the rest
    are too few; with more ranks than GPUs the GPUs are shared, and each worker's KV budget
    is what fits beside the most crowded of its GPUs, shared by role weight (ROLE_WEIGHTS).
    roles: each worker's role (default: all weigh the same). host_bytes: the host memory
    available; on GPUs each worker gets a share of HOST_TIER_FRACTION of it for its host KV
    tier, by role weight, unless the worker flags give --kv-host-memory."""
    explicit_kv = flags.kv_cache_memory or explicit_kv
    if not gpus or flags.device.startswith("cpu"):
        return [Placement((), explicit_kv or cpu_kv) for _ in range(num_workers)]
    tps = [max(1, t) for t in (tps if tps is not None else [flags.tp] * num_workers)]
    if max(tps) > len(gpus):
        raise ValueError(f"--tp {max(tps)} needs {max(tps)} GPUs; {len(gpus)} visible")
    blocks, cursor = [], 0
    for tp in tps:
        start = cursor if cursor + tp <= len(gpus) else 0
        blocks.append(list(range(start, start + tp)))
        cursor = (start + tp) % len(gpus)
    weights = [ROLE_WEIGHTS.get(r, 1) for r in roles] if roles else [1] * len(tps)
    crowd = [sum(g in b for b in blocks) for g in range(len(gpus))]  # workers per GPU
    on_gpu = [[i for i, b in enumerate(blocks) if g in b] for g in range(len(gpus))]
    host_share = (host_bytes * HOST_TIER_FRACTION / sum(weights)) if host_bytes and not flags.kv_host_memory else 0
    places = []
    for i, (tp, block) in enumerate(zip(tps, blocks)):
        per_gpu = max(crowd[g] for g in block)
        shared = per_gpu > 1
        if explicit_kv:
            kv = explicit_kv
        elif shared:
            # on its most crowded GPU: the card's share, less every worker's weights (split tp
            # ways) and 1 GiB each, divided by role weight
            kv = None
            for g in block:
                workers = on_gpu[g]
                room = card_bytes * SHARED_FRACTION - sum(model_bytes // tps[j] + (1 << 30) for j in workers)
                mine = int(room * weights[i] / sum(weights[j] for j in workers))
                kv = mine if kv is None else min(kv, mine)
            kv = str(max(kv, 256 << 20))
        else:
            kv = None
        host = str(int(host_share * weights[i])) if host_share else None
        places.append(Placement(tuple(gpus[g] for g in block), kv, shared, host))
    return places
