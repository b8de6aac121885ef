"""Tensor parallelism across processes, rank 0's side: one process per rank on one host.

The process that creates the Engine is rank 0: it owns the scheduler and samples. It
starts ranks 1..N-1 (new interpreters, never forked: CUDA and gRPC do not survive fork), each of
which builds the same Engine on its own shard and device and then follows: for every
step, rank 0 sends the packed step plan (../step_plan.py) down a pipe to each follower,
and every rank runs the same forward, meeting in the collectives (NCCL on GPU, gloo on
CPU). A pipe rather than a torch.distributed broadcast keeps the control path out of the
collective's timeouts (an idle server can wait for hours) and tells a follower at once
when rank 0 is gone (end of file). Rank 0 can also run a function on every rank
(`call`), e.g. to register each rank's KV pool with a transfer agent. The followers' side
is follower.py, the messages on the pipe control.py."""
from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Listener
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from shared.settings.process_vars import TP_ADDR, TP_KEY

from ..step_plan import StepPlan
from . import control
from .context import TPContext, kv_head_slice

log = logging.getLogger("duet.engine.tp")

# Run by each follower interpreter (a string: importing the follower here would import the
# engine, which imports this module).
# the fast exit first: its exit handler must be registered before torch's (shared/process_exit.py)
FOLLOWER_BOOT = ("from shared.process_exit import FastExit; fast_exit = FastExit.install(); "
                 "from shared.engine.parallel.follower import follower_entry; follower_entry(fast_exit)")


def check_divisible(model_config, tp_size: int, expert_parallel: bool = False) -> None:
    """Clear error before any process starts when the model cannot be split tp_size ways."""
    checks = [("num_attention_heads", model_config.num_heads)]
    moe = model_config.moe
    if moe is None or len(moe.sparse_layers) < model_config.num_layers:  # some dense MLPs
        checks.append(("intermediate_size", model_config.intermediate_size))
    if moe is not None:
        checks.append(("num_experts (expert parallel)", moe.num_experts) if expert_parallel
                      else ("moe_intermediate_size", moe.intermediate_size))
        if moe.shared_expert_intermediate_size:
            checks.append(("shared_expert_intermediate_size", moe.shared_expert_intermediate_size))
    for what, n in checks:
        if n % tp_size:
            raise ValueError(f"cannot split the model over tensor-parallel size {tp_size}: "
                             f"{what} ({n}) is not divisible by {tp_size}")
    try:  # KV heads divide, or each is replicated over tp_size / heads ranks
        kv_head_slice(model_config.num_kv_heads, tp_size, 0)
    except ValueError as exc:
        raise ValueError(f"cannot split the model over tensor-parallel size {tp_size}: {exc}") from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPWorkers:
    """Rank 0's handle on the follower processes."""

    def __init__(self, procs, conns):
        self.procs = procs
        self.conns = conns
        self.closed = False

    def send_plan(self, plan: StepPlan) -> None:
        payload = control.FORWARD + plan.data.tobytes()
        for c in self.conns:
            c.send_bytes(payload)

    def send_sampled(self, start: int, tokens: torch.Tensor, pusher=None) -> None:
        """Overlap scheduling: the step's tokens were sampled on rank 0's device; every
        follower needs them in the same slots [start, start+n) of its own ring, from which
        the next step's placeholder ids are resolved on every rank. With the custom
        all-reduce (`pusher`) rank 0's device writes them into every ring itself and the
        follower queues a device-side wait for that write's epoch; otherwise one NCCL
        broadcast. Neither makes a host wait for the device."""
        epoch = pusher.push_tokens(tokens, start) if pusher is not None else 0
        header = np.asarray([start, tokens.numel(), epoch], dtype=np.int64).tobytes()
        for c in self.conns:
            c.send_bytes(control.SAMPLED + header)
        if pusher is None:
            dist.broadcast(tokens, src=0)

    def call(self, target: str, *args) -> list:
        """Run `module:function(engine, *args)` on every follower; their results in rank
        order (rank 0 runs its own part itself)."""
        msg = control.CALL + pickle.dumps((target, args))
        for c in self.conns:
            c.send_bytes(msg)
        results = []
        for rank, c in enumerate(self.conns, start=1):
            status, value = pickle.loads(c.recv_bytes())
            if status != "ok":
                raise RuntimeError(f"TP rank {rank} failed in {target}:\n{value}")
            results.append(value)
        return results

    def wait_ready(self) -> None:
        for rank, c in enumerate(self.conns, start=1):
            try:
                status, value = pickle.loads(c.recv_bytes())
            except EOFError:
                raise RuntimeError(f"TP rank {rank} exited during start-up") from None
            if status != "ready":
                raise RuntimeError(f"TP rank {rank} failed to start:\n{value}")

    def shutdown(self, timeout: float = 30.0) -> None:
        if self.closed:
            return
        self.closed = True
        for c in self.conns:
            try:
                c.send_bytes(control.STOP)
            except (OSError, EOFError):
                pass
        for rank, p in enumerate(self.procs, start=1):
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                # stuck (e.g. a device-side wait that will never be met): killed. A GPU process
                # can take many seconds to die while the driver tears its context down; closing
                # must not fail for that, so wait a while and then leave it to the OS.
                log.warning("TP rank %d did not stop within %.0fs: killing it", rank, timeout)
                p.kill()
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.error("TP rank %d (pid %d) still exiting %.0fs after SIGKILL", rank, p.pid, timeout)
        for c in self.conns:
            c.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(config, tp_size: int, device: torch.device) -> tuple[TPContext, TPWorkers]:
    """Start ranks 1..tp_size-1 and join them in a process group as rank 0.

    Followers are fresh interpreters (subprocess, not multiprocessing), so a user's script
    without a __main__ guard is never re-run in them; each connects back to an
    authenticated local socket and receives its rank and the engine config."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; "
                           "one tensor-parallel engine per process")
    if device.type == "cuda" and torch.cuda.device_count() < tp_size + (device.index or 0):
        raise ValueError(f"tensor-parallel size {tp_size} needs {tp_size} GPUs from cuda:{device.index or 0}; "
                         f"this host has {torch.cuda.device_count()}")
    init = f"tcp://127.0.0.1:{_free_port()}"
    key = secrets.token_bytes(32)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               **{TP_ADDR.name: "%s:%d" % listener.address, TP_KEY.name: key.hex()})
    procs = [subprocess.Popen([sys.executable, "-c", FOLLOWER_BOOT], env=env) for _ in range(1, tp_size)]
    conns: list = [None] * (tp_size - 1)
    workers = TPWorkers(procs, conns)
    try:
        for rank in range(1, tp_size):
            conn = _accept(listener, procs)
            conn.send((rank, tp_size, init, replace(config, tp=TPContext())))
            conns[rank - 1] = conn
        listener.close()
        dist.init_process_group(control.backend_for(device), init_method=init, rank=0, world_size=tp_size,
                                timeout=control.INIT_TIMEOUT)
    except BaseException:
        listener.close()
        workers.conns = [c for c in conns if c is not None]
        workers.shutdown(timeout=5)
        raise
    return TPContext(rank=0, size=tp_size, group=dist.group.WORLD), workers


def _accept(listener, procs, timeout: float = 300.0):
    """listener.accept(), but give up when a follower died before connecting."""
    sock = listener._listener._socket  # noqa: SLF001 - the only way to bound accept()
    sock.settimeout(1.0)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return listener.accept()
        except (socket.timeout, TimeoutError):
            dead = [p.returncode for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"a tensor-parallel rank did not start (exit codes {dead})") from None
