"""Runs the peer all-reduce kernels as one rank among simulated peers, in one process
(interpreted on CPU, native on one GPU): every rank's buffer is a local tensor. For the push
kernel, before each call the test writes what the other ranks would have pushed (their rows
and flags) into this rank's buffer, and what the kernel wrote into the others' buffers comes
back for checking. For the read kernel every buffer holds its rank's rows, as after the
barrier."""
from __future__ import annotations

import torch

from kernels.triton_peer_all_reduce import push_reduce, push_tokens, wait_tokens
from kernels.triton_peer_read_all_reduce import read_reduce
from shared.engine.parallel.custom_all_reduce import _layout, buffer_bytes, make_peer_buffers

SLOT_BYTES = 1 << 16
PROGRAMS = 4


def _peer_view(buf, world, rank_from, phase, dtype, shape):
    lay_elems = SLOT_BYTES // torch.empty((), dtype=dtype).element_size()
    data = buf[:2 * world * SLOT_BYTES].view(dtype)
    start = (phase * world + rank_from) * lay_elems
    return data[start:start + shape[0] * shape[1]].view(shape)


def _flags(buf, world):
    off = _layout(world, SLOT_BYTES, PROGRAMS)["flags"]
    return buf[off:off + world * PROGRAMS * 8].view(torch.int64).view(world, PROGRAMS)


def run_calls(rank: int, calls, residual, weight, eps: float):
    """calls: list of per-call lists of every rank's partials [T, H]. Returns, per call,
    (out, new_residual, rows each peer received from us, flags each peer holds from us)."""
    world = len(calls[0])
    dev = calls[0][0].device
    bufs = [torch.zeros(buffer_bytes(world, SLOT_BYTES, PROGRAMS), dtype=torch.uint8, device=dev)
            for _ in range(world)]
    peers = make_peer_buffers(rank, [b.data_ptr() for b in bufs], bufs[rank], SLOT_BYTES, dev, PROGRAMS)
    results = []
    for e, partials in enumerate(calls, start=1):
        x = partials[rank]
        for q in range(world):  # what rank q pushed to us this call
            if q != rank:
                _peer_view(bufs[rank], world, q, e % 2, x.dtype, x.shape).copy_(partials[q])
                _flags(bufs[rank], world)[q].fill_(e)
        out, res = push_reduce(peers, x, residual, weight, eps, max_spins=1000)
        got = [_peer_view(bufs[q], world, rank, e % 2, x.dtype, x.shape).clone() for q in range(world)]
        flags = [_flags(bufs[q], world)[rank].clone() for q in range(world)]
        results.append((out, res, got, flags))
    return results, int(peers.errors.item()), peers.counters.clone()


def run_tokens(rank: int, world: int, tokens: torch.Tensor, start: int):
    """Push tokens as `rank`, then wait for an epoch already reached and for one that never
    comes, then once more after that failure (which must not spin). Returns (each rank's ring
    slice, each rank's token flag, errors after each wait)."""
    dev = tokens.device
    bufs = [torch.zeros(buffer_bytes(world, SLOT_BYTES, PROGRAMS), dtype=torch.uint8, device=dev)
            for _ in range(world)]
    all_peers = [make_peer_buffers(r, [b.data_ptr() for b in bufs], bufs[r], SLOT_BYTES, dev, PROGRAMS)
                 for r in range(world)]
    push_tokens(all_peers[rank], tokens, start, epoch=3)
    rings = [p.ring[start:start + tokens.numel()].clone() for p in all_peers]
    flags = [int(p.my_token_flag.item()) for p in all_peers]
    follower = all_peers[(rank + 1) % world]
    wait_tokens(follower, 3, max_spins=1000)
    ok_errors = int(follower.errors.item())
    wait_tokens(follower, 4, max_spins=1000)  # never pushed: gives up and counts it
    missing_errors = int(follower.errors.item())
    wait_tokens(follower, 5, max_spins=1 << 30)  # after a failure: no spinning at all
    return rings, flags, ok_errors, missing_errors, int(follower.errors.item())


def run_read_reduce(rank: int, partials, residual, weight, eps: float):
    """The read kernel as `rank`, each rank's buffer holding its partials [T, H] at its start
    and NaN after them (a read past the rows shows). Returns (out, new_residual)."""
    bufs = []
    for p in partials:
        buf = torch.full((p.numel() + 4 * p.shape[-1],), float("nan"), dtype=p.dtype, device=p.device)
        buf[:p.numel()].copy_(p.reshape(-1))
        bufs.append(buf)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=partials[0].device)
    return read_reduce(ptrs, len(partials), partials[rank], residual, weight, eps)
