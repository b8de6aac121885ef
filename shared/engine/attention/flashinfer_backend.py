"""Attention through FlashInfer's paged kernels, used when the package is importable and
asked for (--attention-backend flashinfer). K/V are stored by our store_kv kernel; the
pool's per-layer views are passed as (k, v) in FlashInfer's HND layout
[pages, kv_heads, page_size, head_dim] with the pool's page and head strides (pages are
head-major, kv_pool.py, so a layer's heads are not adjacent; FlashInfer reads the strides
from the tensors it is given, which nobody could check here either).

Each step is planned once (prepare), not per layer: page index lists in CSR form
(indptr over pages, page ids, fill of each last page). CUDA graphs are not captured for
this backend yet (supports_cuda_graph False): FlashInfer needs one wrapper per captured
batch size with fixed index buffers, which nobody here could test without the package."""
from __future__ import annotations

import torch

from .base import AttentionBackend
from .metadata import AttentionMetadata

_WORKSPACE_BYTES = 128 << 20


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = False

    def __init__(self, pool):
        super().__init__(pool)
        import flashinfer

        dev = pool.device
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, kv_layout="HND")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="HND")
        self._planned: AttentionMetadata | None = None
        self._num_q_heads: int | None = None

    def _csr(self, meta: AttentionMetadata):
        ps, dev = meta.page_size, self.pool.device
        npages = meta.num_pages_host
        indptr = [0]
        for n in npages:
            indptr.append(indptr[-1] + n)
        table = meta.page_table
        cols = torch.arange(table.shape[1], device=table.device)
        indices = table[cols[None, :] < torch.tensor(npages, device=table.device)[:, None]]
        last = [s - (n - 1) * ps for s, n in zip(meta.seq_lens_host, npages)]
        i32 = dict(dtype=torch.int32, device=dev)
        return torch.tensor(indptr, **i32), indices.to(torch.int32), torch.tensor(last, **i32)

    def _plan(self, meta: AttentionMetadata, num_q_heads: int, q_dtype, scale: float) -> None:
        layout = self.pool.layout
        indptr, indices, last = self._csr(meta)
        if meta.is_decode:
            self._decode.plan(indptr, indices, last, num_q_heads, layout.num_kv_heads, layout.head_dim,
                              meta.page_size, q_data_type=q_dtype, kv_data_type=layout.dtype, sm_scale=scale)
        else:
            self._prefill.plan(meta.qo_indptr, indptr, indices, last, num_q_heads, layout.num_kv_heads,
                               layout.head_dim, meta.page_size, causal=True, q_data_type=q_dtype,
                               kv_data_type=layout.dtype, sm_scale=scale)
        self._planned = meta
        self._num_q_heads = num_q_heads

    def forward(self, q, k, v, layer, meta: AttentionMetadata, scale, kv_stored: bool = False):
        from kernels.store_kv import store_kv

        kc, vc = self.kv_cache(layer)
        if not kv_stored:
            store_kv(kc, vc, k, v, meta.slot_mapping)
        if self._planned is not meta or self._num_q_heads != q.shape[1]:
            self._plan(meta, q.shape[1], q.dtype, scale)  # first layer of the step
        wrapper = self._decode if meta.is_decode else self._prefill
        return wrapper.run(q.contiguous(), (kc, vc))
