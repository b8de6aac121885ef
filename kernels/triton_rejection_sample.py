"""Triton kernel behind kernels.rejection_sample (imported lazily: needs triton).

Grid (B,): the program walks the request's drafts (K is small and static), then scans the
vocabulary once in BLOCK_V tiles keeping the running Gumbel maximum of the residual (or of
p after a full acceptance). The Gumbel noise is the sampler's hash (kernels/gumbel_noise.py)
evaluated in float64, so a draw equals the torch reference's."""

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _gumbel(key, idx):
    x = key ^ ((idx * 0x61C88647) & 0xFFFFFFFF)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    u = (x.to(tl.float64) + 0.5) / 4294967296.0
    return (-tl.log(-tl.log(u))).to(tl.float32)


@triton.jit
def _rejection_kernel(
    tlp, dp, dt, nd, uu, keys, acc_out, fin_out,
    s_tb, s_tk, s_db, s_dk, s_tokb, s_ub, s_kb,
    V, K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(nd + b).to(tl.int32)
    a = tl.zeros((), tl.int32)
    alive = tl.full((), 1, tl.int1)
    for j in tl.static_range(K):
        x = tl.load(dt + b * s_tokb + j)
        p = tl.exp(tl.load(tlp + b * s_tb + j * s_tk + x))
        q = tl.load(dp + b * s_db + j * s_dk + x)
        u = tl.load(uu + b * s_ub + j)
        take = alive & (j < n) & (u * q < p)
        a += take.to(tl.int32)
        alive = take
    key = tl.load(keys + b * s_kb + a)
    resid = a < n
    row_t = tlp + b * s_tb + a * s_tk
    row_d = dp + b * s_db + tl.minimum(a, K - 1) * s_dk
    best = tl.full((), float("-inf"), tl.float32)
    arg = tl.zeros((), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        ok = v < V
        lp = tl.load(row_t + v, mask=ok, other=float("-inf"))
        if resid:  # names the scalar draft loop used are not reused: Triton keeps one type a name
            qv = tl.load(row_d + v, mask=ok, other=0.0)
            r = tl.maximum(tl.exp(lp) - qv, 0.0)
            val = tl.log(r)
        else:
            val = lp
        val = tl.where(ok, val + _gumbel(key, v.to(tl.int64)), float("-inf"))
        m = tl.max(val, 0)
        i = tl.argmax(val, 0).to(tl.int64) + v0
        better = m > best
        arg = tl.where(better, i, arg)
        best = tl.where(better, m, best)
    if resid and best == float("-inf"):  # p <= q everywhere only by rounding: draw from p
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            ok = v < V
            lp = tl.load(row_t + v, mask=ok, other=float("-inf"))
            val = tl.where(ok, lp + _gumbel(key, v.to(tl.int64)), float("-inf"))
            m = tl.max(val, 0)
            i = tl.argmax(val, 0).to(tl.int64) + v0
            better = m > best
            arg = tl.where(better, i, arg)
            best = tl.where(better, m, best)
    tl.store(acc_out + b, a.to(tl.int64))
    tl.store(fin_out + b, arg)


def launch_rejection_sample(target_logp, draft_probs, draft_tokens, num_draft, u, keys):
    B, K1, V = target_logp.shape
    tlp = target_logp.float().contiguous()
    dp = draft_probs.float().contiguous()
    dt = draft_tokens.to(torch.int64).contiguous()
    uu = u.to(torch.float64).contiguous()
    ks = keys.to(torch.int64).contiguous()
    acc = torch.empty(B, dtype=torch.int64, device=tlp.device)
    fin = torch.empty(B, dtype=torch.int64, device=tlp.device)
    if B == 0:
        return acc, fin
    _rejection_kernel[(B,)](
        tlp, dp, dt, num_draft.to(torch.int32).contiguous(), uu, ks, acc, fin,
        tlp.stride(0), tlp.stride(1), dp.stride(0), dp.stride(1), dt.stride(0), uu.stride(0), ks.stride(0),
        V, K=K1 - 1, BLOCK_V=BLOCK_V, num_warps=4,
    )
    return acc, fin
