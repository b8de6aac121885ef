"""All-reduce between the GPUs of one host over peer-mapped buffers, fused with the
residual add and RMSNorm that follow every row-parallel layer (tensor parallelism).

Each rank owns one buffer in torch symmetric memory (CUDA IPC mappings of every peer's
buffer, no NVLink multicast). Modes (EngineConfig.custom_all_reduce_mode,
DUET_CUSTOM_ALLREDUCE):

- "fused" (default): one Triton launch per call that pushes this rank's rows into every
  rank's buffer, signals with per-program flags in the same memory, waits for the
  others' flags, sums in rank order and applies add+RMSNorm
  (kernels/triton_peer_all_reduce.py). No separate barrier kernels: torch's signal-pad
  barriers (two per call, each a signal round trip) would be most of a TP decode step.
- "barrier": copy into this rank's buffer, torch symm-mem barrier, a Triton kernel that
  reads every peer's buffer and does the same sum + add + RMSNorm
  (kernels/triton_peer_read_all_reduce.py), barrier again.
- "oneshot": torch's one_shot_all_reduce_copy_out, then our add+RMSNorm kernel.

Every rank gets the same bits (rank-order float32 sums). Sizes over the buffer or dtypes
it does not handle return None: the caller uses NCCL.

The same buffer also holds a token ring with a flag: under overlap scheduling rank 0
pushes each step's sampled tokens into every rank's ring (push_tokens) and a follower
queues a wait for them before its next forward (wait_tokens), with no collective."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("duet.engine.custom_all_reduce")

DEFAULT_MAX_BYTES = 8 << 20  # one-shot pays off for small messages (decode, short prefills)
PROGRAMS = 32  # fixed grid of the fused kernel (every program takes part in every call)
# above this the barrier mode is faster (the fused kernel pushes with its fixed grid, which limits
# bandwidth on large messages); both ranks pick by shape, so they always agree. Mixing the modes is
# safe: a barrier call writes this rank's own phase-0 slot only after every rank finished the
# fused calls before it, and the fused calls after it wait for the barrier call to end.
FUSED_MAX_BYTES = 512 << 10
RING_SLOTS = 1 << 15  # token ring entries (int64)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Symmetric-memory rendezvous keeps per-process state keyed by group name: a process that
# already did one (an earlier engine, since torn down) cannot rendezvous again with a fresh
# peer process (it hangs). A process fact, so a module flag.
_RENDEZVOUS_DONE = False

MODES = ("fused", "barrier", "oneshot")


@dataclass
class PeerBuffers:
    """Addresses and counters the fused kernels read (kernels/triton_peer_all_reduce.py)."""
    rank: int
    world: int
    programs: int
    slot_bytes: int  # one rank's rows per phase
    data_ptrs: torch.Tensor  # int64 [W]: each rank's data region ([2][W] slots)
    flag_ptrs: torch.Tensor  # int64 [W]: each rank's flags ([W][programs] int64)
    my_flags: torch.Tensor  # this rank's flags (a view of its buffer)
    counters: torch.Tensor  # int64 [programs]: calls made by each program (local)
    errors: torch.Tensor  # int32 [1]: waits that gave up (a peer never arrived)
    ring_ptrs: torch.Tensor  # int64 [W]: each rank's token ring
    token_flag_ptrs: torch.Tensor  # int64 [W]: each rank's token flag
    my_token_flag: torch.Tensor  # int64 [1] view
    ring: torch.Tensor  # int64 [RING_SLOTS] view: this rank's token ring

    def slot_elems(self, element_size: int) -> int:
        return self.slot_bytes // element_size


def _layout(world: int, slot_bytes: int, programs: int) -> dict[str, int]:
    """Byte offsets in each rank's buffer (the same on every rank)."""
    def up(n):
        return -(-n // 4096) * 4096
    flags = 2 * world * slot_bytes
    token_flag = flags + up(world * programs * 8)
    ring = token_flag + 4096
    return dict(flags=flags, token_flag=token_flag, ring=ring, total=ring + RING_SLOTS * 8)


def make_peer_buffers(rank: int, ptrs: list[int], own: torch.Tensor, slot_bytes: int,
                      device: torch.device, programs: int = PROGRAMS) -> PeerBuffers:
    """PeerBuffers over every rank's buffer (`ptrs`, this rank's is `own`, uint8)."""
    world = len(ptrs)
    lay = _layout(world, slot_bytes, programs)
    if own.numel() < lay["total"]:
        raise ValueError(f"peer buffer of {own.numel()} bytes, the layout needs {lay['total']}")

    def at(off):
        return torch.tensor([p + off for p in ptrs], dtype=torch.int64, device=device)

    def view(off, n):
        return own[off:off + n * 8].view(torch.int64)

    return PeerBuffers(
        rank=rank, world=world, programs=programs, slot_bytes=slot_bytes,
        data_ptrs=at(0), flag_ptrs=at(lay["flags"]), my_flags=view(lay["flags"], world * programs),
        counters=torch.zeros(programs, dtype=torch.int64, device=device),
        errors=torch.zeros(1, dtype=torch.int32, device=device),
        ring_ptrs=at(lay["ring"]), token_flag_ptrs=at(lay["token_flag"]),
        my_token_flag=view(lay["token_flag"], 1), ring=view(lay["ring"], RING_SLOTS))


def buffer_bytes(world: int, slot_bytes: int, programs: int = PROGRAMS) -> int:
    return _layout(world, slot_bytes, programs)["total"]


class CustomAllReduce:
    def __init__(self, group, rank: int, world_size: int, device: torch.device,
                 max_bytes: int = DEFAULT_MAX_BYTES, mode: str = "fused"):
        import torch.distributed._symmetric_memory as symm_mem

        if mode not in MODES:
            raise ValueError(f"unknown custom all-reduce mode {mode!r}; choose one of {', '.join(MODES)}")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.max_bytes = max_bytes
        self.mode = mode
        group = group or dist.group.WORLD
        self.group_name = group.group_name
        self._one_shot = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
        if mode == "oneshot" and self._one_shot is None:
            raise RuntimeError("this torch has no symm_mem.one_shot_all_reduce_copy_out")
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch, a no-op (or deprecated) on newer
            try:
                enable(group.group_name)
            except Exception:  # noqa: BLE001 - newer torch may refuse an already-enabled group
                pass
        global _RENDEZVOUS_DONE
        _RENDEZVOUS_DONE = True
        self.buffer = symm_mem.empty(buffer_bytes(world_size, max_bytes), dtype=torch.uint8, device=device)
        self.buffer.zero_()  # flags start at 0 on every rank before anyone signals
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.peer_ptrs = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.peers = make_peer_buffers(rank, list(self.handle.buffer_ptrs), self.buffer, max_bytes, device)
        self.token_epoch = 0  # token pushes made (rank 0) / waited for (followers)
        self.handle.barrier(channel=0)  # every rank zeroed its flags
        torch.cuda.synchronize(device)

    @staticmethod
    def fresh_process() -> bool:
        """False once this process has set one up; ranks must agree before trying."""
        return not _RENDEZVOUS_DONE

    @classmethod
    def try_create(cls, tp, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES, mode: str = "fused"):
        """All ranks must call this together. None (with a log line) where it cannot work."""
        if device.type != "cuda" or tp.size < 2:
            return None
        try:
            car = cls(tp.group, tp.rank, tp.size, device, max_bytes, mode)
            car.self_check()
            return car
        except Exception as e:  # noqa: BLE001 - any failure means: use NCCL
            log.warning("custom all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
            return None

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype in _DTYPES and x.is_cuda and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def _symm_view(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        return self.buffer[:nbytes].view(x.dtype).view(x.shape)

    def _reduce(self, x, residual, weight, eps):
        mode = self.mode
        if mode == "fused" and x.numel() * x.element_size() > FUSED_MAX_BYTES:
            mode = "barrier"  # prefill-sized: reading the peers beats pushing with a fixed grid
        if mode == "fused":
            from kernels.triton_peer_all_reduce import push_reduce
            return push_reduce(self.peers, x, residual, weight, eps)
        if mode == "oneshot":
            summed = self._one_shot(self._symm_view(x), x, "sum", self.group_name, torch.empty_like(x))
            if residual is None:
                return summed, None
            from kernels.rms_norm import rms_norm
            return rms_norm(summed, weight, eps, residual)
        from kernels.triton_peer_read_all_reduce import read_reduce
        self._symm_view(x).copy_(x)
        self.handle.barrier(channel=0)
        out = read_reduce(self.peer_ptrs, self.world_size, x, residual, weight, eps)
        self.handle.barrier(channel=1)
        return out

    def all_reduce_add_rms_norm(self, x, residual, weight, eps: float):
        """(rms_norm(sum_ranks(x) + residual) * weight, sum_ranks(x) + residual), or None."""
        if not self.fits(x) or residual.dtype != x.dtype or x.dim() != 2:
            return None
        return self._reduce(x, residual, weight, eps)

    def __call__(self, x: torch.Tensor):
        """Plain sum across ranks (TPContext.all_reduce), or None."""
        if not self.fits(x):
            return None
        flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        out, _ = self._reduce(flat.contiguous(), None, None, 0.0)
        return out.view(x.shape)

    # -- sampled tokens under overlap scheduling ------------------------------------------
    def token_ring(self, capacity: int) -> torch.Tensor | None:
        """This rank's ring for `capacity` tokens, which the other ranks can write, or None."""
        return self.peers.ring[:capacity] if capacity <= RING_SLOTS else None

    def push_tokens(self, tokens: torch.Tensor, start: int) -> int:
        """Write tokens into ring[start:] of every rank; returns the epoch a follower waits for."""
        from kernels.triton_peer_all_reduce import push_tokens
        self.token_epoch += 1
        push_tokens(self.peers, tokens.to(torch.int64).contiguous(), start, self.token_epoch)
        return self.token_epoch

    def wait_tokens(self, epoch: int) -> None:
        from kernels.triton_peer_all_reduce import wait_tokens
        wait_tokens(self.peers, epoch)

    def failed_waits(self) -> int:
        """Waits that gave up because a peer never arrived (syncs the device)."""
        return int(self.peers.errors.item())

    def self_check(self) -> None:
        """A small reduction at start: every rank contributes rank+1; wrong sums or a
        mapping that does not work fail here, not in the first request."""
        x = torch.full((4, 256), float(self.rank + 1), dtype=torch.float32, device=self.device)
        out = self(x)
        want = self.world_size * (self.world_size + 1) / 2
        torch.cuda.synchronize(self.device)
        if out is None or not torch.all(out == want) or self.failed_waits():
            raise RuntimeError(f"{self.mode} all-reduce self-check gave a wrong sum")
