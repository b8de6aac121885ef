"""One-launch all-reduce between GPUs of one host, with its own in-kernel signalling,
fused with the residual add and RMSNorm (the reference is peer_all_reduce.py).

Every rank runs the same grid of G programs. Program p of rank r, for the rows it owns
(p, p+G, ...):
  1. stores them into slot [phase][r] of every rank's buffer (remote stores over NVLink
     are posted writes: cheaper than remote reads);
  2. block barrier, then one release store (system scope) of its epoch into flag [r][p]
     of every rank;
  3. spins (acquire) until flag [q][p] of its own buffer reached the epoch for every rank q;
  4. sums slot [phase][0..W-1] of its own buffer in rank order in float32 (every rank
     gets the same bits), rounds, adds the residual, normalises.

No barrier kernels, no end-of-call barrier: each program counts its calls in device
memory (`counters`, so CUDA graph replays count too), and the data alternates between
two phases by epoch parity. Why that is safe: when program p of rank r writes phase
e%2 at call e, it has finished call e-1, in which it saw every rank's program p start
call e-1; a rank starts a call only after its previous kernel ended (stream order), so
every rank finished reading call e-2's slots, the last users of that phase. This needs
every program to exist in every call, hence the fixed grid, and every rank to make the
same sequence of calls (they do: collectives run in lockstep).

A rank that never arrives (its process died) would leave the others spinning: the wait
gives up after MAX_SPINS polls (tens of seconds) and counts the failure in `errors`; once
that is non-zero no later wait spins, so a dead peer ends in wrong numbers (and rank 0's
control pipe reports the dead process) rather than a hung GPU.

Also here: pushing a step's sampled tokens into every rank's token ring with a flag,
and a kernel that waits for that flag (overlap scheduling under TP without a
collective per step)."""
import torch
import triton
import triton.language as tl

MAX_SPINS = 1 << 26


@triton.jit
def _wait_at_least(flag, epoch, errors, MAX: tl.constexpr):
    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    # after one wait gave up (a peer is gone) the rest do not wait: the process is going down,
    # and 73 all-reduces a step each spinning out would hold it for an hour
    spins = tl.where(tl.load(errors, volatile=True) == 0, 0, MAX)
    while (seen < epoch) & (spins < MAX):
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        spins += 1
    if seen < epoch:
        tl.atomic_add(errors, 1)


@triton.jit
def _push_reduce_kernel(x, residual, weight, out, res_out,
                        data_ptrs, flag_ptrs, my_flags, counters, errors,
                        n_rows, n_cols, slot_elems, eps,
                        stride_x, stride_res, stride_out, stride_ro,
                        RANK: tl.constexpr, WORLD: tl.constexpr, G: tl.constexpr,
                        NORM: tl.constexpr, BLOCK: tl.constexpr, MAX: tl.constexpr):
    pid = tl.program_id(0)
    epoch = tl.load(counters + pid) + 1
    tl.store(counters + pid, epoch)
    phase = epoch % 2
    dt = out.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    slot = slot_elems.to(tl.int64)
    # 1. this program's rows into slot [phase][RANK] of every rank
    for row in range(pid, n_rows, G):
        v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0)
        for r in tl.static_range(WORLD):
            base = tl.load(data_ptrs + r).to(tl.pointer_type(dt))
            dst = base + (phase * WORLD + RANK) * slot + row * n_cols
            tl.store(dst + cols, v, mask=ok)
    tl.debug_barrier()
    # 2. announce them
    for r in tl.static_range(WORLD):
        fl = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(fl + RANK * G + pid, epoch, sem="release", scope="sys")
    # 3. wait for every rank's rows
    for r in tl.static_range(WORLD):
        _wait_at_least(my_flags + r * G + pid, epoch, errors, MAX)
    tl.debug_barrier()
    # 4. reduce in rank order, then add + RMSNorm
    mine = tl.load(data_ptrs + RANK).to(tl.pointer_type(dt))
    for row in range(pid, n_rows, G):
        r64 = row  # offsets stay under the slot (<= 8 MiB): int32 is enough
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(WORLD):
            src = mine + (phase * WORLD + r) * slot + r64 * n_cols
            acc += tl.load(src + cols, mask=ok, other=0.0, cache_modifier=".cv").to(tl.float32)
        s = acc.to(dt)
        if NORM:
            rv = tl.load(residual + r64 * stride_res + cols, mask=ok, other=0.0)
            h = (s.to(tl.float32) + rv.to(tl.float32)).to(dt)
            tl.store(res_out + r64 * stride_ro + cols, h, mask=ok)
            hf = h.to(tl.float32)
            inv_rms = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n_cols + eps)
            wv = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(out + r64 * stride_out + cols, (hf * inv_rms * wv).to(dt), mask=ok)
        else:
            tl.store(out + r64 * stride_out + cols, s, mask=ok)


# start/n/epoch change every step: specialising on them (== 1, multiple of 16) would compile
# new variants in the middle of serving, a compile inside a step
@triton.jit(do_not_specialize=["n", "start", "epoch"])
def _push_tokens_kernel(tokens, n, start, epoch, ring_ptrs, flag_ptrs,
                        RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    for off in range(0, n, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < n
        v = tl.load(tokens + idx, mask=m)
        for r in tl.static_range(WORLD):
            ring = tl.load(ring_ptrs + r).to(tl.pointer_type(tl.int64))
            tl.store(ring + start + idx, v, mask=m)
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != RANK:
            fl = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(fl, epoch, sem="release", scope="sys")


@triton.jit(do_not_specialize=["epoch"])
def _wait_kernel(flag, epoch, errors, MAX: tl.constexpr):
    _wait_at_least(flag, epoch, errors, MAX)


def push_reduce(peers, x: torch.Tensor, residual, weight, eps: float, max_spins: int = MAX_SPINS):
    """x: [T, H] this rank's partial sums. `peers` (custom_all_reduce.PeerBuffers) holds
    the mapped addresses and counters. Returns (out, new_residual) with a residual, else
    (sum, None)."""
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    norm = residual is not None
    res_out = torch.empty_like(x) if norm else out
    block = triton.next_power_of_2(n_cols)
    res = residual if norm else x
    _push_reduce_kernel[(peers.programs,)](
        x, res, weight if norm else x, out, res_out,
        peers.data_ptrs, peers.flag_ptrs, peers.my_flags, peers.counters, peers.errors,
        n_rows, n_cols, peers.slot_elems(x.element_size()), eps,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        RANK=peers.rank, WORLD=peers.world, G=peers.programs, NORM=norm, BLOCK=block,
        MAX=max_spins, num_warps=min(16, max(4, block // 512)))
    return out, (res_out if norm else None)


def push_tokens(peers, tokens: torch.Tensor, start: int, epoch: int) -> None:
    """tokens [n] int64 into ring[start:start+n] of every rank, then flag = epoch on the others."""
    n = tokens.numel()
    _push_tokens_kernel[(1,)](tokens, n, start, epoch, peers.ring_ptrs, peers.token_flag_ptrs,
                              RANK=peers.rank, WORLD=peers.world, BLOCK=256, num_warps=4)


def wait_tokens(peers, epoch: int, max_spins: int = MAX_SPINS) -> None:
    """Queue a wait (on this rank's stream) until the pushed tokens of `epoch` landed here."""
    _wait_kernel[(1,)](peers.my_token_flag, epoch, peers.errors, MAX=max_spins, num_warps=1)
