"""All-reduce by reading every peer's buffer, fused with the residual add and RMSNorm (the
"barrier" mode of shared/engine/parallel/custom_all_reduce.py; the reference is
peer_all_reduce.py, the same function as triton_peer_all_reduce.py's push kernel).

Every rank has already copied its partial sums into its own peer-mapped buffer and passed
a barrier; then one program per row reads the row from every rank's buffer (raw addresses
in `peer_ptrs`), sums in rank order in float32, rounds to the input dtype (as an unfused
all-reduce would), then optionally adds the residual (rounded again, as the unfused add)
and applies RMSNorm. Loads of peer memory bypass the L1 cache (.cv): the data was written by
another GPU since this SM may last have read that address.

Imported lazily (needs triton). The kernel needs no second GPU: given the addresses of
local buffers it runs anywhere Triton does (its test runs it under the CPU interpreter)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _reduce_kernel(peer_ptrs, residual, weight, out, res_out, n_cols, eps,
                   stride_res, stride_out, stride_ro,
                   WORLD: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WORLD):
        base = tl.load(peer_ptrs + r).to(tl.pointer_type(out.dtype.element_ty))
        acc += tl.load(base + row * n_cols + cols, mask=ok, other=0.0, cache_modifier=".cv").to(tl.float32)
    x = acc.to(out.dtype.element_ty)
    if NORM:
        rv = tl.load(residual + row * stride_res + cols, mask=ok, other=0.0)
        h = (x.to(tl.float32) + rv.to(tl.float32)).to(out.dtype.element_ty)
        tl.store(res_out + row * stride_ro + cols, h, mask=ok)
        hf = h.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n_cols + eps)
        wv = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + row * stride_out + cols, (hf * inv_rms * wv).to(out.dtype.element_ty), mask=ok)
    else:
        tl.store(out + row * stride_out + cols, x, mask=ok)


def read_reduce(peer_ptrs, world: int, x, residual, weight, eps: float):
    """x: [T, H] this rank's partial sums, already copied to the start of its buffer (every
    rank's buffer holds its [T, H] rows there, contiguous); peer_ptrs: int64 [world], each
    rank's buffer address. Returns (out, new_residual) with a residual, else (sum, None)."""
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    norm = residual is not None
    res_out = torch.empty_like(x) if norm else out
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        res = residual if norm else x
        _reduce_kernel[(n_rows,)](
            peer_ptrs, res, weight if norm else x, out, res_out, n_cols, eps,
            res.stride(0), out.stride(0), res_out.stride(0),
            WORLD=world, NORM=norm, BLOCK=block, num_warps=min(16, max(4, block // 256)))
    return out, (res_out if norm else None)
