"""Write new tokens' K/V into the paged cache (the engine's 'set_kv_buffer').

An FP8 cache (float8_e4m3fn) stores k / k_scale and v / v_scale, saturated at +-448 and
rounded to nearest even (kernels/fp8.py kv_cache_values); readers multiply by the scales.
Other caches store k and v cast to their dtype and ignore the scales."""

from kernels.fp8 import kv_cache_values
from kernels.paged_kv import PagedCacheShape


def _check(k_cache, v_cache, k, v, slot_mapping) -> PagedCacheShape:
    shape = PagedCacheShape.of(k_cache, v_cache)
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (shape.num_kv_heads, shape.head_dim):
        raise ValueError(f"k/v must be [T, {shape.num_kv_heads}, {shape.head_dim}], got {tuple(k.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError("slot_mapping must be [T]")
    return shape


def store_kv_reference(k_cache, v_cache, k, v, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Plain torch. Slots < 0 are padding and are skipped."""
    shape = _check(k_cache, v_cache, k, v, slot_mapping)
    slots = slot_mapping.long()
    keep = slots >= 0
    slots, k, v = slots[keep], k[keep], v[keep]
    pages, offs = slots // shape.page_size, slots % shape.page_size
    k_cache[pages, :, offs, :] = kv_cache_values(k, k_cache.dtype, k_scale)
    v_cache[pages, :, offs, :] = kv_cache_values(v, v_cache.dtype, v_scale)


def store_kv(k_cache, v_cache, k, v, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Triton. Same contract as the reference; one program per token."""
    _check(k_cache, v_cache, k, v, slot_mapping)
    from kernels.triton_store_kv import launch_store_kv

    launch_store_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
