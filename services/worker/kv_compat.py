"""Which workers can pair: a hash of the served model, its checkpoint (weights and tokenizer:
services/worker/checkpoint.py) and the whole model's KV layout, which every worker publishes
and the router and both sides of a transfer compare."""
from __future__ import annotations

import hashlib


def compat_hash(served_model: str, kv_key: str, checkpoint: str = "") -> str:
    """Model + checkpoint + KV layout of the whole model (not per rank): workers at any TP
    sizes whose hashes match can pair, the writer re-sharding heads on the way
    (kv_transfer/head_plan.py); two checkpoints served under one name never do."""
    return hashlib.sha256(f"{served_model}|{checkpoint}|{kv_key}".encode()).hexdigest()[:16]


def model_kv_key(engine) -> str:
    """L<layers>-H<kv heads>-P<page>-D<head dim>-<KV dtype>-<page order> (heads_first), and for an FP8 cache
    with scales other than 1.0 a digest of them (pages written with one scale read wrong with
    another). The page order (kv_pool.py) is there so that a worker of a build that laid a
    page out differently never pairs with this one during a rolling upgrade."""
    layout, mc = engine.layout, engine.model_config
    key = (f"L{layout.num_layers}-H{mc.num_kv_heads}-P{layout.page_size}-D{layout.head_dim}-"
           f"{str(layout.dtype).removeprefix('torch.')}-{layout.page_order}")
    scales = engine.pool.scales
    if any(s != (1.0, 1.0) for s in scales):
        key += "-kvs" + hashlib.sha256(repr(scales).encode()).hexdigest()[:8]
    return key
