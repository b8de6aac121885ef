"""Tile sizes for the fused MoE GEMMs, by token count, as SGLang and vLLM keep per-shape
tables. TUNED holds what a device sweep measured best (docs/performance/kernels.md), keyed by
(experts, hidden, expert intermediate, top_k, dtype name) and then by token-count bucket;
`heuristic` covers every other shape."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmTile:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoEConfig:
    """Both GEMMs share block_m (the expert-padded row blocks are built once)."""
    gate_up: GemmTile
    down: GemmTile

    @property
    def block_m(self) -> int:
        return self.gate_up.block_m


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

def _t(bm, bn, bk, g, w, st):
    return GemmTile(bm, bn, bk, g, w, st)


# (experts, hidden, intermediate, top_k, dtype) -> {bucket: MoEConfig}, from the sweep on one GPU
TUNED: dict[tuple, dict[int, MoEConfig]] = {
    (128, 2048, 768, 8, "bfloat16"): {  # Qwen3-30B-A3B
        1: MoEConfig(_t(16, 64, 128, 1, 4, 4), _t(16, 64, 128, 1, 4, 3)),
        8: MoEConfig(_t(16, 32, 256, 1, 4, 3), _t(16, 64, 128, 1, 4, 4)),
        32: MoEConfig(_t(16, 32, 128, 1, 4, 3), _t(16, 64, 128, 1, 4, 3)),
        128: MoEConfig(_t(16, 64, 64, 4, 4, 4), _t(16, 64, 64, 4, 4, 3)),
        1024: MoEConfig(_t(64, 64, 64, 8, 4, 3), _t(64, 128, 64, 8, 4, 3)),
        4096: MoEConfig(_t(128, 128, 64, 8, 8, 3), _t(128, 128, 64, 8, 8, 3)),
    },
    (128, 2048, 384, 8, "bfloat16"): {  # its TP=2 shard
        1: MoEConfig(_t(16, 32, 128, 1, 4, 4), _t(16, 64, 128, 1, 4, 3)),
        8: MoEConfig(_t(16, 32, 128, 1, 4, 3), _t(16, 64, 128, 1, 4, 3)),
        32: MoEConfig(_t(16, 32, 128, 1, 4, 3), _t(16, 32, 128, 1, 4, 3)),
        128: MoEConfig(_t(16, 64, 64, 4, 4, 3), _t(16, 64, 64, 4, 4, 3)),
        1024: MoEConfig(_t(64, 64, 64, 8, 4, 3), _t(64, 128, 64, 8, 4, 3)),
        4096: MoEConfig(_t(128, 64, 64, 8, 8, 3), _t(128, 64, 64, 8, 8, 3)),
    },
}


def bucket(m: int) -> int:
    return next((b for b in BUCKETS if m <= b), BUCKETS[-1])


def heuristic(m: int, num_experts: int, top_k: int) -> MoEConfig:
    """Few rows per expert (decode): 16-row blocks, narrow N tiles so the touched experts'
    weights spread over every SM; many (prefill): large tiles, grouped along M for reuse."""
    rows_per_expert = m * top_k / max(1, num_experts)
    if rows_per_expert <= 4:
        t = GemmTile(16, 64, 128, 1, 4, 4)
        return MoEConfig(t, t)
    if rows_per_expert <= 32:
        t = GemmTile(32, 64, 64, 4, 4, 4)
        return MoEConfig(t, t)
    if rows_per_expert <= 128:
        t = GemmTile(64, 128, 64, 8, 4, 3)
        return MoEConfig(t, t)
    t = GemmTile(128, 128, 64, 8, 8, 3)
    return MoEConfig(t, t)


def get_config(m: int, num_experts: int, hidden: int, intermediate: int, top_k: int, dtype_name: str) -> MoEConfig:
    """The tuned entry of the smallest swept token count >= m (the largest past the end)."""
    table = TUNED.get((num_experts, hidden, intermediate, top_k, dtype_name))
    if table:
        keys = sorted(table)
        return table[next((k for k in keys if k >= m), keys[-1])]
    return heuristic(m, num_experts, top_k)
