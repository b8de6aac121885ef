"""Which prefill and decode workers can hand KV to each other, and why a pair cannot.

Two workers pair when they serve the same model, from the same checkpoint (a fingerprint of
the weights and tokenizer, not only the name), with the same KV layout (compat_hash:
layers, KV heads, page size, head dim, KV dtype, the order inside a page and an FP8 cache's
scales; not the TP size) and every KV head a decode
rank holds is held by some prefill rank (kv_transfer/head_plan.py), which is true for any
two TP sizes that divide (or are multiples of) the KV-head count. Results are cached per
pair of layouts: the router asks on every request."""
from __future__ import annotations

import functools

from shared.kv_transfer.head_plan import RankHeads, pairing_problem
from shared.kv_transfer.pool_info import PoolInfo
from shared.registry.worker_info import WorkerInfo


def _heads(info: WorkerInfo) -> tuple[RankHeads, ...]:
    return tuple(RankHeads.of(PoolInfo.from_record(p)) for p in sorted(info.kv_pools, key=lambda p: p.rank))


# the readable KV layout (services/worker: L<layers>-H<kv heads>-P<page>-D<head dim>-<dtype>
# -<page order>[-kvs<scales digest>]), field by field, for saying which part of two layouts
# differs. Builds before the page order was named laid pages out layers first.
_LAYOUT_FIELDS = {"L": "layers", "H": "KV heads", "P": "page size", "D": "head dim"}
_PAGE_ORDERS = ("heads_first", "layers_first")


def _layout_fields(layout: str) -> dict[str, str]:
    fields = {"KV-cache scales": "none", "page order": "layers_first"}
    for part in layout.split("-"):
        if part in _PAGE_ORDERS:
            fields["page order"] = part
        elif part.startswith("kvs"):
            fields["KV-cache scales"] = part[3:]
        elif part[:1] in _LAYOUT_FIELDS and part[1:].isdigit():
            fields[_LAYOUT_FIELDS[part[:1]]] = part[1:]
        else:
            fields["kv dtype"] = part
    return fields


def layout_difference(prefill_layout: str, decode_layout: str) -> str:
    """Which fields of two readable KV layouts differ, e.g. "kv dtype bfloat16 vs
    float8_e4m3fn"; "" when neither names a difference (hashes differ by the model)."""
    p, d = _layout_fields(prefill_layout), _layout_fields(decode_layout)
    out = []
    for name in ("kv dtype", "layers", "KV heads", "page size", "head dim", "page order", "KV-cache scales"):
        a, b = p.get(name, "?"), d.get(name, "?")
        if a != b:
            out.append(f"{name} {a} vs {b}")
    return ", ".join(out)


@functools.lru_cache(maxsize=4096)
def _problem(prefill_key: tuple, decode_key: tuple, prefill_heads: tuple, decode_heads: tuple) -> str:
    (p_hash, p_layout, p_tp, p_ckpt), (d_hash, d_layout, d_tp, d_ckpt) = prefill_key, decode_key
    if p_ckpt and d_ckpt and p_ckpt != d_ckpt:
        return f"checkpoints differ: prefill {p_ckpt}, decode {d_ckpt} (weights or tokenizer)"
    if p_hash != d_hash:
        diff = layout_difference(p_layout, d_layout) if p_layout and d_layout else ""
        return (f"KV layouts differ: prefill {p_layout or p_hash} (tp {p_tp}), "
                f"decode {d_layout or d_hash} (tp {d_tp})" + (f": {diff}" if diff else ""))
    if not prefill_heads and not decode_heads:
        return ""  # entries that describe no pools (made by hand): the hash is all we know
    problem = pairing_problem(prefill_heads, decode_heads)
    return f"tp {p_tp} -> tp {d_tp}: {problem}" if problem else ""


def pair_problem(prefill: WorkerInfo, decode: WorkerInfo) -> str:
    """"" when prefill can write its KV into decode, else the reason it cannot. The answer
    depends on the two layouts only, so it is cached by them."""
    key = lambda w: (w.compat_hash, w.kv_layout, w.tp, w.checkpoint)  # noqa: E731
    return _problem(key(prefill), key(decode), _heads(prefill), _heads(decode))
