"""One-shot all-reduce over peer-mapped buffers, fused with the residual add and RMSNorm
that follow every row-parallel layer (tensor parallelism on one host).

Each rank owns one buffer in torch symmetric memory (CUDA IPC mappings of every peer's
buffer, no NVLink multicast). A call: copy the partial sums into this rank's buffer,
barrier (every rank has written), one Triton kernel per row that reads all ranks'
buffers over NVLink, sums them in rank order in float32 (so every rank gets the same
bits), adds the residual, normalises and scales, then barrier (every rank has read,
so the buffer may be written again). NCCL's ring all-reduce needs several hops and its
own launch for the small decode messages; this is one read of each peer and it also
removes the separate add+norm kernel.

The barriers are torch's signal-pad barriers (device kernels, CUDA-graph safe). Sizes
over the buffer, or dtypes it does not handle, return None: the caller uses NCCL.

mode "oneshot" (DUET_CUSTOM_ALLREDUCE=oneshot) instead uses torch's one-shot kernel that
copies the local input into the symmetric buffer, synchronises with the peers and sums
in one launch (`symm_mem.one_shot_all_reduce_copy_out`), then our fused add+RMSNorm:
two graph nodes per all-reduce instead of four."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("duet.engine.custom_all_reduce")

DEFAULT_MAX_BYTES = 8 << 20  # one-shot pays off for small messages (decode, short prefills)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Symmetric-memory rendezvous keeps per-process state keyed by group name: a process that
# already did one (an earlier engine, since torn down) cannot rendezvous again with a fresh
# peer process (seen hanging on 2 x H200). A process fact, so a module flag.
_RENDEZVOUS_DONE = False


MODES = ("fused", "oneshot")


class CustomAllReduce:
    def __init__(self, group, rank: int, world_size: int, device: torch.device,
                 max_bytes: int = DEFAULT_MAX_BYTES, mode: str = "fused"):
        import torch.distributed._symmetric_memory as symm_mem

        if mode not in MODES:
            raise ValueError(f"unknown custom all-reduce mode {mode!r}; choose {' or '.join(MODES)}")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.max_bytes = max_bytes
        self.mode = mode
        group = group or dist.group.WORLD
        self.group_name = group.group_name
        if mode == "oneshot":
            self._one_shot = torch.ops.symm_mem.one_shot_all_reduce_copy_out  # AttributeError: older torch
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch, a no-op (or deprecated) on newer
            try:
                enable(group.group_name)
            except Exception:  # noqa: BLE001 - newer torch may refuse an already-enabled group
                pass
        global _RENDEZVOUS_DONE
        _RENDEZVOUS_DONE = True
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.peer_ptrs = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=device)

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

    def _publish(self, x: torch.Tensor) -> None:
        nbytes = x.numel() * x.element_size()
        self.buffer[:nbytes].view(x.dtype).view(x.shape).copy_(x)
        self.handle.barrier(channel=0)

    def _symm_view(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        return self.buffer[:nbytes].view(x.dtype).view(x.shape)

    def all_reduce_add_rms_norm(self, x, residual, weight, eps: float):
        """(rms_norm(sum_ranks(x) + residual) * weight, sum_ranks(x) + residual), or None."""
        if not self.fits(x) or residual.dtype != x.dtype or x.dim() != 2:
            return None
        if self.mode == "oneshot":
            from kernels.rms_norm import rms_norm
            summed = self._one_shot(self._symm_view(x), x, "sum", self.group_name, torch.empty_like(x))
            return rms_norm(summed, weight, eps, residual)
        self._publish(x)
        from .custom_all_reduce_kernel import launch_reduce

        out, res = launch_reduce(self.peer_ptrs, self.world_size, x, residual, weight, eps)
        self.handle.barrier(channel=1)
        return out, res

    def __call__(self, x: torch.Tensor):
        """Plain sum across ranks (TPContext.all_reduce), or None."""
        if not self.fits(x):
            return None
        flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if self.mode == "oneshot":
            out = self._one_shot(self._symm_view(flat), flat.contiguous(), "sum", self.group_name,
                                 torch.empty_like(flat))
            return out.view(x.shape)
        self._publish(flat)
        from .custom_all_reduce_kernel import launch_reduce

        out, _ = launch_reduce(self.peer_ptrs, self.world_size, flat, None, None, 0.0)
        self.handle.barrier(channel=1)
        return out.view(x.shape)

    def self_check(self) -> None:
        """A small reduction at start: every rank contributes rank+1; wrong sums or a
        mapping that does not work fail here, not in the first request."""
        x = torch.full((4, 256), float(self.rank + 1), dtype=torch.float32, device=self.device)
        out = self(x)
        want = self.world_size * (self.world_size + 1) / 2
        torch.cuda.synchronize(self.device)
        if out is None or not torch.all(out == want):
            raise RuntimeError("one-shot all-reduce self-check gave a wrong sum")
