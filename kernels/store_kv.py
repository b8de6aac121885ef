"""Write new tokens' K/V into the paged cache (the engine's 'set_kv_buffer')."""

import torch

from kernels.paged_kv import PagedCacheShape


def _check(k_cache, v_cache, k, v, slot_mapping) -> PagedCacheShape:
    shape = PagedCacheShape.of(k_cache, v_cache)
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (shape.num_kv_heads, shape.head_dim):
        raise ValueError(f"k/v must be [T, {shape.num_kv_heads}, {shape.head_dim}], got {tuple(k.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError("slot_mapping must be [T]")
    return shape


def store_kv_reference(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Plain torch. Slots < 0 are padding and are skipped."""
    shape = _check(k_cache, v_cache, k, v, slot_mapping)
    slots = slot_mapping.long()
    keep = slots >= 0
    slots, k, v = slots[keep], k[keep], v[keep]
    pages, offs = slots // shape.page_size, slots % shape.page_size
    k_cache[pages, :, offs, :] = k.to(k_cache.dtype)
    v_cache[pages, :, offs, :] = v.to(v_cache.dtype)


def store_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Triton. Same contract as the reference; one program per token."""
    _check(k_cache, v_cache, k, v, slot_mapping)
    from kernels.triton_store_kv import launch_store_kv

    launch_store_kv(k_cache, v_cache, k, v, slot_mapping)
