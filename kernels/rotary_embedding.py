"""Rotary position embedding, applied in place to q and k.

cos_sin_cache is [max_pos, D]: cos in the first D/2 columns, sin in the last
D/2 (rotary_dim = head_dim). is_neox=True rotates the two halves of a head
(HF Llama/Qwen 'rotate_half'); False rotates interleaved pairs (GPT-J).
q is [T, H_q*D] or [T, H_q, D]; k likewise with H_kv heads. Last dim contiguous;
the token stride may be anything (q and k can be slices of one qkv output).
"""

import torch


def _as_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    if x.dim() == 2:
        if x.shape[1] % head_dim:
            raise ValueError(f"width {x.shape[1]} is not a multiple of head_dim {head_dim}")
        return x.view(x.shape[0], x.shape[1] // head_dim, head_dim)
    if x.dim() != 3 or x.shape[2] != head_dim:
        raise ValueError(f"expected [T, H*{head_dim}] or [T, H, {head_dim}], got {tuple(x.shape)}")
    return x


def _check(positions, q, k, cos_sin_cache):
    head_dim = cos_sin_cache.shape[1]
    if head_dim % 2:
        raise ValueError("head_dim must be even")
    if positions.shape != (q.shape[0],) or k.shape[0] != q.shape[0]:
        raise ValueError("positions must be [T] with q and k of T tokens")
    return head_dim


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x [T, H, D] in the math dtype; cos/sin [T, 1, D/2]."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding_reference(positions, q, k, cos_sin_cache, is_neox: bool = True):
    head_dim = _check(positions, q, k, cos_sin_cache)
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
    cos, sin = cos_sin_cache[positions.long()].to(acc).unsqueeze(1).chunk(2, dim=-1)
    for x in (q, k):
        xh = _as_heads(x, head_dim)
        xh.copy_(_rotate_reference(xh.to(acc), cos, sin, is_neox).to(x.dtype))
    return q, k


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox: bool = True):
    """Triton, one program per token covering all q and k heads."""
    head_dim = _check(positions, q, k, cos_sin_cache)
    from kernels.triton_rotary_embedding import launch_rotary_embedding

    launch_rotary_embedding(positions, _as_heads(q, head_dim), _as_heads(k, head_dim), cos_sin_cache, is_neox)
    return q, k
