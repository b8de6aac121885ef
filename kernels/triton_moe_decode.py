"""Triton kernels behind kernels.moe_decode (imported lazily: needs triton).

Two launches for a decode batch's MoE block, none of them single-program:
- _router_topk_kernel, grid (T, E / BLOCK_E): each program computes BLOCK_E router logits of
  one token (a slice of the [E, H] router weight); the program that arrives last for its
  token (an arrival counter) does the softmax and top-k over the E logits.
- _experts_kernel, one grid of two kinds of programs: gate/up per (token, slot) pair,
  column block and K chunk (partial sums; the last chunk of a column block adds them and
  applies SiLU-and-mul); down per pair and output column block, which loads
  its weights, waits for its pair's gate/up programs (an arrival counter), multiplies by
  the routing weight into a scratch row; the program arriving last for a (token, column
  block) sums the token's k rows in slot order (deterministic whatever the arrival order).
One launch for both GEMVs lets the down weights stream while gate/up computes and pays a
short kernel's ramp and tail once.
Arrival counters start at zero and the last program puts its counter back to zero, so the
buffer can live across CUDA-graph replays. Stores are ordered before the counter's
acq_rel increment by a CTA barrier; the readers go through L2. Waiting programs only wait
on lower program ids (dispatched first), and give up after MAX_SPINS polls."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_for
from kernels.triton_moe_topk import TL_DTYPES, softmax_topk, softmax_topk_sorted
from kernels.triton_pdl import pdl_enter, prefetch_l2


@triton.jit
def _router_topk_kernel(x_ptr, wr_ptr, logits_ptr, counter_ptr, weights_out, ids_out, E, H, stride_x,
                        TOP_K: tl.constexpr, TOP_KP: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr,
                        ROUND_TO: tl.constexpr, LOGIT_DT: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr, LINE_ELEMS: tl.constexpr,
                        SORT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    e = nb * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    if PDL:  # the router weight is constant: ask L2 for this program's rows while the norm finishes
        lines = tl.minimum(tl.arange(0, BLOCK_K // LINE_ELEMS) * LINE_ELEMS, H - 1)
        prefetch_l2(wr_ptr + tl.minimum(e, E - 1)[:, None].to(tl.int64) * H + lines[None, :])
        pdl_enter(PDL)
    acc = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        xv = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(wr_ptr + e[:, None].to(tl.int64) * H + k[None, :], mask=e_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    logit = tl.sum(acc, axis=1).to(LOGIT_DT).to(tl.float32)  # the router linear's output dtype
    tl.store(logits_ptr + t * E + e, logit, mask=e_ok)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + t, 1, sem="acq_rel")
    if arrived == tl.num_programs(1) - 1:  # the last block of this token: route it
        cols = tl.arange(0, EP)
        ok = cols < E
        x = tl.load(logits_ptr + t * E + cols, mask=ok, other=float("-inf"), cache_modifier=".cg")
        if SORT:
            softmax_topk_sorted(x, ok, cols, weights_out, ids_out, t, TOP_K, EP, RENORM, ROUND_TO)
        else:
            softmax_topk(x, ok, cols, weights_out, ids_out, t, TOP_K, TOP_KP, RENORM, ROUND_TO)
        tl.store(counter_ptr + t, 0)


MAX_SPINS = 1 << 24


@triton.jit
def _row_scales(s_ptr, srow_ptr, e, n, k0, stride_se, stride_sr, group_k, FP8: tl.constexpr):
    """FP8 weights: the scales of rows n of expert e for the K group holding column k0 (a
    tile's K range lies in one group); 1.0 for 16-bit weights."""
    if FP8:
        row = tl.load(srow_ptr + n).to(tl.int64)
        return tl.load(s_ptr + e.to(tl.int64) * stride_se + row * stride_sr + k0 // group_k)
    else:
        return tl.full(n.shape, 1.0, tl.float32)


@triton.jit
def _group_scaled_sums(w, v, s_ptr, srow_ptr, e, n, k0, stride_se, stride_sr, group_k, n_groups,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr):
    """FP8 rows w [BLOCK_N, BLOCK_K] whose columns from k0 span BLOCK_K // SUB_K scale groups
    (SUB_K == the group): each row's products with v summed per group, times that group's scale,
    then summed: [BLOCK_N]. A group past the weight's last reads the last scale (times zeros)."""
    G: tl.constexpr = BLOCK_K // SUB_K
    part = tl.sum(tl.reshape(w.to(tl.float32) * v[None, :], (BLOCK_N, G, SUB_K)), axis=2)
    row = tl.load(srow_ptr + n).to(tl.int64)
    cols = tl.minimum(k0 // group_k + tl.arange(0, G), n_groups - 1)
    sc = tl.load(s_ptr + e.to(tl.int64) * stride_se + row[:, None] * stride_sr + cols[None, :])
    return tl.sum(part * sc, axis=1)


@triton.jit
def _gate_up_part(x_ptr, w13_ptr, part_ptr, e, pair, nb, ks, num_splits, H, I, stride_x, stride_we,
                  s13_ptr, srow13_ptr, stride_s13e, stride_s13r, group_k, groups13,
                  TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
                  SUB_K: tl.constexpr):
    """Partial gate and up sums over one K chunk for BLOCK_N intermediate columns of a pair:
    one load of each tile, so every program has its whole share of bytes in flight at once."""
    t = pair // TOP_K
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    k = ks * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < H
    rows = w13_ptr + e.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * H + k[None, :]
    m = n_ok[:, None] & k_ok[None, :]
    g = tl.load(rows, mask=m, other=0.0)
    u = tl.load(rows + I * H, mask=m, other=0.0)
    xv = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
    nc = tl.minimum(n, I - 1)
    base = part_ptr + (pair * num_splits + ks) * 2 * I
    if FP8 and BLOCK_K > SUB_K:  # the tile spans several scale groups
        gs = _group_scaled_sums(g, xv, s13_ptr, srow13_ptr, e, nc, ks * BLOCK_K, stride_s13e, stride_s13r,
                                group_k, groups13, BLOCK_N, BLOCK_K, SUB_K)
        us = _group_scaled_sums(u, xv, s13_ptr, srow13_ptr, e, nc + I, ks * BLOCK_K, stride_s13e, stride_s13r,
                                group_k, groups13, BLOCK_N, BLOCK_K, SUB_K)
        tl.store(base + n, gs, mask=n_ok)
        tl.store(base + I + n, us, mask=n_ok)
    else:
        sg = _row_scales(s13_ptr, srow13_ptr, e, nc, ks * BLOCK_K, stride_s13e, stride_s13r, group_k, FP8)
        su = _row_scales(s13_ptr, srow13_ptr, e, nc + I, ks * BLOCK_K, stride_s13e, stride_s13r, group_k, FP8)
        tl.store(base + n, tl.sum(g.to(tl.float32) * xv[None, :], axis=1) * sg, mask=n_ok)
        tl.store(base + I + n, tl.sum(u.to(tl.float32) * xv[None, :], axis=1) * su, mask=n_ok)


@triton.jit
def _gate_up_finish(part_ptr, inter_ptr, pair, nb, num_splits, I, BLOCK_N: tl.constexpr):
    """The K chunks' partial sums added in chunk order, rounded as the unfused matmul leaves
    gate and up, then silu(g)*u."""
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    g = tl.zeros([BLOCK_N], tl.float32)
    u = tl.zeros([BLOCK_N], tl.float32)
    for ks in range(0, num_splits):
        base = part_ptr + (pair * num_splits + ks) * 2 * I
        g += tl.load(base + n, mask=n_ok, other=0.0, cache_modifier=".cg")
        u += tl.load(base + I + n, mask=n_ok, other=0.0, cache_modifier=".cg")
    dt = inter_ptr.dtype.element_ty
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    tl.store(inter_ptr + pair * I + n, (g / (1.0 + tl.exp(-g)) * u).to(dt), mask=n_ok)


@triton.jit(do_not_specialize=["num_pairs"])  # one compile for every decode batch
def _experts_kernel(x_ptr, w13_ptr, w2_ptr, ids_ptr, emap_ptr, topk_w_ptr, part_ptr, inter_ptr, rows_ptr,
                    split_ptr, pair_done_ptr, pair_seen_ptr, sum_ptr, out_ptr,
                    s13_ptr, srow13_ptr, s2_ptr, srow2_ptr,
                    H, I, num_pairs, stride_x, stride_w13e, stride_w2e, stride_out,
                    stride_s13e, stride_s13r, stride_s2e, stride_s2r, group_k, groups13, groups2,
                    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, GATE_N: tl.constexpr, GATE_K: tl.constexpr,
                    DOWN_N: tl.constexpr, DOWN_K: tl.constexpr, MAX: tl.constexpr, PDL: tl.constexpr,
                    FP8: tl.constexpr, SUB_K: tl.constexpr):
    """Per pair, I/GATE_N * H/GATE_K gate/up programs: partial sums of a column block over one
    K chunk; the last chunk to arrive for a (pair, column block) adds them up, applies
    SiLU-and-mul and arrives on the pair's counter. And H/DOWN_N down programs: the pair's
    down projection for DOWN_N output columns. Those load their weight tile first (it depends
    only on the routing), then wait for the pair's gate/up blocks (lower program ids, so
    already running or done). The last down program of a (token, column block) sums the
    token's k rows in slot order; the last of a pair zeroes the pair's counters.
    All gate/up programs come first: ordering them pair by pair, so one pair's down
    projection streams while the next pairs' gate/up run, is slower: its spinning down
    programs hold SM slots the gate/up programs need.
    FP8 weights (W8A16): each tile row is scaled by its block scale; a K tile either lies in one
    scale group or spans whole groups (SUB_K: the group), summed per group then scaled."""
    pdl_enter(PDL)  # everything here depends on the routing the previous kernel wrote
    pid = tl.program_id(0)
    nb_gate = tl.cdiv(I, GATE_N)
    splits = tl.cdiv(H, GATE_K)
    nb_down = tl.cdiv(H, DOWN_N)
    per_gate = nb_gate * splits
    is_gate = pid < num_pairs * per_gate
    if is_gate:
        pair = pid // per_gate
        r = pid % per_gate
    else:
        pair = (pid - num_pairs * per_gate) // nb_down
        r = (pid - num_pairs * per_gate) % nb_down
    pair = pair.to(tl.int64)
    if is_gate:
        nb = r // splits
        e = tl.load(ids_ptr + pair)
        if HAS_MAP:
            e = tl.load(emap_ptr + e)
        if e >= 0:  # another rank's expert: nothing to compute, the down side writes zeros
            _gate_up_part(x_ptr, w13_ptr, part_ptr, e, pair, nb, r % splits, splits, H, I, stride_x, stride_w13e,
                          s13_ptr, srow13_ptr, stride_s13e, stride_s13r, group_k, groups13, TOP_K, GATE_N, GATE_K,
                          FP8, SUB_K)
        tl.debug_barrier()
        split_counter = split_ptr + pair * nb_gate + nb
        if tl.atomic_add(split_counter, 1, sem="acq_rel") == splits - 1:
            if e >= 0:
                _gate_up_finish(part_ptr, inter_ptr, pair, nb, splits, I, GATE_N)
            tl.store(split_counter, 0)
            tl.debug_barrier()
            tl.atomic_add(pair_done_ptr + pair, 1, sem="release")
    else:
        nb = r
        t = pair // TOP_K
        n = nb * DOWN_N + tl.arange(0, DOWN_N)
        n_ok = n < H
        k = tl.arange(0, DOWN_K)
        e = tl.load(ids_ptr + pair)
        if HAS_MAP:
            e = tl.load(emap_ptr + e)
        w_rows = w2_ptr + tl.maximum(e, 0).to(tl.int64) * stride_w2e + n[:, None].to(tl.int64) * I
        live = n < tl.where(e >= 0, H, 0)  # another rank's expert: no weights to read
        w = tl.load(w_rows + k[None, :], mask=live[:, None] & (k < I)[None, :], other=0.0)
        done = tl.load(pair_done_ptr + pair, volatile=True)  # polled by plain loads, not atomics
        spins = 0
        while (done < nb_gate) & (spins < MAX):
            done = tl.load(pair_done_ptr + pair, volatile=True)
            spins += 1
        tl.atomic_add(pair_done_ptr + pair, 0, sem="acquire")  # the pair's intermediate is visible
        y = tl.zeros([DOWN_N], tl.float32)
        if e >= 0:
            ec = tl.maximum(e, 0)
            nc = tl.minimum(n, H - 1)
            iv = tl.load(inter_ptr + pair * I + k, mask=k < I, other=0.0, cache_modifier=".cg").to(tl.float32)
            if FP8 and DOWN_K > SUB_K:  # tiles spanning several scale groups: summed per group
                total = _group_scaled_sums(w, iv, s2_ptr, srow2_ptr, ec, nc, 0, stride_s2e, stride_s2r, group_k,
                                           groups2, DOWN_N, DOWN_K, SUB_K)
                for k0 in range(DOWN_K, I, DOWN_K):  # intermediates wider than one tile (Mixtral)
                    kk = k0 + k
                    ivk = tl.load(inter_ptr + pair * I + kk, mask=kk < I, other=0.0, cache_modifier=".cg")
                    wk = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < I)[None, :], other=0.0)
                    total += _group_scaled_sums(wk, ivk.to(tl.float32), s2_ptr, srow2_ptr, ec, nc, k0, stride_s2e,
                                                stride_s2r, group_k, groups2, DOWN_N, DOWN_K, SUB_K)
            else:
                sw = _row_scales(s2_ptr, srow2_ptr, ec, nc, 0, stride_s2e, stride_s2r, group_k, FP8)
                acc = w.to(tl.float32) * sw[:, None] * iv[None, :]
                for k0 in range(DOWN_K, I, DOWN_K):  # intermediates wider than one tile (Mixtral)
                    kk = k0 + k
                    ivk = tl.load(inter_ptr + pair * I + kk, mask=kk < I, other=0.0, cache_modifier=".cg")
                    wk = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < I)[None, :], other=0.0)
                    sw = _row_scales(s2_ptr, srow2_ptr, ec, nc, k0, stride_s2e, stride_s2r, group_k, FP8)
                    acc += wk.to(tl.float32) * sw[:, None] * ivk.to(tl.float32)[None, :]
                total = tl.sum(acc, axis=1)
            dt = out_ptr.dtype.element_ty
            y = total.to(dt).to(tl.float32) * tl.load(topk_w_ptr + pair)
        tl.store(rows_ptr + pair * H + n, y, mask=n_ok)
        tl.debug_barrier()
        if tl.atomic_add(pair_seen_ptr + pair, 1, sem="acq_rel") == nb_down - 1:
            tl.store(pair_done_ptr + pair, 0)  # every down program of the pair is past its wait
            tl.store(pair_seen_ptr + pair, 0)
        counter = sum_ptr + t * nb_down + nb
        if tl.atomic_add(counter, 1, sem="acq_rel") == TOP_K - 1:  # the token's last slot here
            acc = tl.zeros([DOWN_N], tl.float32)
            for j in tl.static_range(TOP_K):
                acc += tl.load(rows_ptr + (t * TOP_K + j) * H + n, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + t * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.store(counter, 0)


def router_counters(tokens: int, num_experts: int, tile) -> int:
    return tokens * triton.cdiv(num_experts, tile.router_block_e)


def down_counters(tokens: int, top_k: int, hidden: int, intermediate: int, tile) -> int:
    """Per token its column blocks' arrivals; per pair two counters and one per gate/up
    column block."""
    return tokens * (triton.cdiv(hidden, tile.down_block_n) + top_k * (2 + triton.cdiv(intermediate,
                                                                                     tile.gate_up_block_n)))


def launch_route(x, router_w, top_k: int, renormalize: bool, round_weights_to, counters, tile, pdl=None):
    t, h = x.shape
    pdl = pdl_for(pdl, t)
    e = router_w.shape[0]
    dev = x.device
    logits = torch.empty(t, e, dtype=torch.float32, device=dev)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    _router_topk_kernel[(t, triton.cdiv(e, tile.router_block_e))](
        x, router_w, logits, counters, weights, ids, e, h, x.stride(0), TOP_K=top_k,
        TOP_KP=triton.next_power_of_2(top_k), EP=triton.next_power_of_2(e), RENORM=renormalize,
        ROUND_TO=TL_DTYPES.get(round_weights_to), LOGIT_DT=TL_DTYPES.get(router_w.dtype, tl.float32),
        BLOCK_E=tile.router_block_e, BLOCK_K=tile.router_block_k, PDL=pdl is not None,
        LINE_ELEMS=min(tile.router_block_k, 128 // router_w.element_size()), num_warps=tile.router_warps,
        SORT=tile.router_sort, **launch_options(pdl))
    return weights, ids


def launch_experts(x, w13, w2, weights, ids, expert_map, out, counters, tile, pdl=None, fp8=None):
    """fp8: (w13, w2) kernels.fp8.Fp8Weight whose q are w13 and w2 (FP8 experts)."""
    t, h = x.shape
    pdl = pdl_for(pdl, t)
    top_k = ids.shape[1]
    inter = w2.shape[2]
    dev = x.device
    pairs = t * top_k
    nb_down = triton.cdiv(h, tile.down_block_n)
    sums = counters[:t * nb_down]
    pair_done = counters[t * nb_down:t * nb_down + pairs]
    pair_seen = counters[t * nb_down + pairs:t * nb_down + 2 * pairs]
    nb_gate = triton.cdiv(inter, tile.gate_up_block_n)
    split = counters[t * nb_down + 2 * pairs:t * nb_down + 2 * pairs + pairs * nb_gate]
    splits = triton.cdiv(h, tile.gate_up_block_k)
    emap = expert_map if expert_map is not None else ids
    part = torch.empty(pairs * splits * 2 * inter, dtype=torch.float32, device=dev)
    inter_rows = torch.empty(pairs, inter, dtype=x.dtype, device=dev)
    rows = torch.empty(pairs, h, dtype=torch.float32, device=dev)
    grid = (pairs * (nb_gate * splits + nb_down),)
    down_k = min(triton.next_power_of_2(inter), tile.down_block_k)
    sub_k = max(tile.gate_up_block_k, down_k)
    if fp8 is not None:
        f13, f2 = fp8
        scales = (f13.scale, f13.scale_row, f2.scale, f2.scale_row)
        scale_strides = (f13.scale.stride(0), f13.scale.stride(1), f2.scale.stride(0), f2.scale.stride(1),
                         min(f13.group_k, 1 << 30), f13.scale.shape[-1], f2.scale.shape[-1])
        sub_k = min(sub_k, f13.group_k)  # a tile wider than a group is summed group by group
    else:
        scales, scale_strides = (x, ids, x, ids), (0, 0, 0, 0, 1, 1, 1)
    _experts_kernel[grid](
        x, w13, w2, ids, emap, weights, part, inter_rows, rows, split, pair_done, pair_seen, sums, out, *scales,
        h, inter, pairs, x.stride(0), w13.stride(0), w2.stride(0), out.stride(0), *scale_strides,
        TOP_K=top_k, HAS_MAP=expert_map is not None, GATE_N=tile.gate_up_block_n, GATE_K=tile.gate_up_block_k,
        DOWN_N=tile.down_block_n, DOWN_K=down_k, MAX=MAX_SPINS,
        PDL=pdl is not None, FP8=fp8 is not None, SUB_K=sub_k, num_warps=tile.warps, **launch_options(pdl))
    return out
