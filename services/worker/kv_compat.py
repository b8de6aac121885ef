"""Which workers can pair: a hash of the served model and the whole model's KV layout, which
every worker publishes and the router and both sides of a transfer compare."""
from __future__ import annotations

import hashlib


def compat_hash(served_model: str, kv_key: str) -> str:
    """Model + KV layout of the whole model (not per rank): workers at any TP sizes whose
    hashes match can pair, the writer re-sharding heads on the way (kv_transfer/head_plan.py)."""
    return hashlib.sha256(f"{served_model}|{kv_key}".encode()).hexdigest()[:16]


def model_kv_key(engine) -> str:
    layout, mc = engine.layout, engine.model_config
    return (f"L{layout.num_layers}-H{mc.num_kv_heads}-P{layout.page_size}-D{layout.head_dim}-"
            f"{str(layout.dtype).removeprefix('torch.')}")
