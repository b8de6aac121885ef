"""Exit when a peer whose GPU memory this process mapped has left, so that memory is freed.

Between GPUs of one host, NIXL's UCX backend writes with cuda_ipc: the first write into a
peer's KV pool opens the pool's IPC handle in this process, and UCX keeps that mapping until
this process exits. Removing the NIXL peer or the whole agent does not close it (an open UCX
issue, openucx/ucx#11753). While it is open, the driver keeps the peer's pool allocated after
the peer is gone, so its replacement finds no GPU memory: on 2 x H200 a SIGKILLed decode
worker's 102 GiB pool stayed taken and its restarts failed with `no GPU memory left for the KV
cache` until the stack stopped (docs/performance/serving.md). Only this process's exit frees it.

So a worker that wrote into such a peer watches the registry, and when the peer leaves (its
entry lapses or is removed, or it comes back as a new instance) it waits a moment (the dead
peer's streams move to other decode workers, and their prompts' pages may come from this
worker's cache), then drains as on SIGTERM and exits; its supervisor (`duet up`, the kubelet)
starts it again. Pools in host memory (the CPU), peers on other hosts or in another PID
namespace (k8s pods: cuda_ipc needs one) map nothing that outlives the peer."""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("duet.worker.peer_memory")

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
PID_NAMESPACE = "/proc/self/ns/pid"
AFTER_LEAVE_S = 3.0  # from noticing the peer gone to the drain: its streams' moves take ~2 s


def ipc_domain() -> str:
    """This host's boot and this process's PID namespace: two processes that share both can
    open each other's CUDA IPC handles. "" where either cannot be read."""
    try:
        return f"{BOOT_ID.read_text().strip()}/{os.readlink(PID_NAMESPACE)}"
    except OSError:
        return ""


def maps_peer_memory(mode: str, mine: str, mine_on_gpu: bool, peer) -> bool:
    """Whether writing into `peer` (a WorkerInfo) leaves a mapping of its memory in this process
    that outlives it. mode: the --exit-for-peer-memory setting; mine: this worker's ipc_domain."""
    if mode == "on":
        return True
    if mode == "off":
        return False
    on_gpu = bool(peer.kv_pools) and all(p.mem_type == "VRAM" for p in peer.kv_pools)
    return mine_on_gpu and on_gpu and bool(mine) and peer.ipc_domain == mine


@dataclass
class PeerMemoryExit:
    """A service of the worker host (start / async stop while serving). written(): the
    (worker id, instance nonce) pairs this process's agents have written into; workers(): the
    registry's live workers; drain(reason): stop as on SIGTERM. A peer counts as gone when it is
missing from the view while this worker is in it, and again after_leave_s later."""

    written: Callable[[], set[tuple[str, str]]]
    workers: Callable[[], list]
    drain: Callable[[str], None]
    mode: str
    mine: str
    mine_on_gpu: bool
    me: str = ""  # this worker's id
    interval_s: float = 1.0
    after_leave_s: float = AFTER_LEAVE_S
    mapped: dict[tuple[str, str], bool] = field(default_factory=dict)  # (id, nonce) -> maps_peer_memory
    _task: asyncio.Task | None = None

    def start(self) -> None:
        if self.mode != "off":
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if (gone := self.check()) is None:
                continue
            log.warning("worker %s left after this process wrote into its GPU memory, which stays allocated until "
                        "this process exits (UCX cuda_ipc keeps the mapping): draining and exiting in %.0fs unless "
                        "it is back, so that it can start again; the supervisor restarts this worker", gone,
                        self.after_leave_s)
            await asyncio.sleep(self.after_leave_s)
            if self.check() == gone:  # still gone (a Redis restarted empty looks like a leave for a heartbeat)
                self.drain(f"peer {gone} left holding memory this process mapped")
                return
            log.info("worker %s is back: not exiting", gone)

    def check(self) -> str | None:
        """The id of a peer written into, whose memory stays mapped here, that is no longer live;
        None too while this worker itself is missing from the view (the registry is not whole:
        Redis restarted, every worker registering again)."""
        live = {(w.worker_id, w.instance_nonce): w for w in self.workers()}
        if self.me and not any(wid == self.me for wid, _ in live):
            return None
        for key, w in live.items():
            if key not in self.mapped:
                self.mapped[key] = maps_peer_memory(self.mode, self.mine, self.mine_on_gpu, w)
        written = self.written()
        return next((wid for (wid, nonce), maps in sorted(self.mapped.items())
                     if maps and (wid, nonce) in written and (wid, nonce) not in live), None)
