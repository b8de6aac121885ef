"""Tensor parallelism across processes: one process per rank on one host.

The process that creates the Engine is rank 0: it owns the scheduler and samples. It
starts ranks 1..N-1 (new interpreters, never forked: CUDA and gRPC do not survive fork), each of
which builds the same Engine on its own shard and device and then follows: for every
step, rank 0 sends the packed step plan (step_plan.py) down a pipe to each follower,
and every rank runs the same forward, meeting in the collectives (NCCL on GPU, gloo on
CPU). A pipe rather than a torch.distributed broadcast keeps the control path out of the
collective's timeouts (an idle server can wait for hours) and tells a follower at once
when rank 0 is gone (end of file). Rank 0 can also run a function on every rank
(`call`), e.g. to register each rank's KV pool with a transfer agent."""
from __future__ import annotations

import importlib
import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Client, Listener
from dataclasses import replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .parallel import TPContext, kv_head_slice
from .step_plan import StepPlan

log = logging.getLogger("duet.engine.tp")

_FORWARD, _CALL, _STOP, _SAMPLED = b"F\0\0\0", b"C\0\0\0", b"S\0\0\0", b"T\0\0\0"
INIT_TIMEOUT = timedelta(minutes=10)


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


def _backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


class TPWorkers:
    """Rank 0's handle on the follower processes."""

    def __init__(self, procs, conns):
        self.procs = procs
        self.conns = conns
        self.closed = False

    def send_plan(self, plan: StepPlan) -> None:
        payload = _FORWARD + plan.data.tobytes()
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
            c.send_bytes(_SAMPLED + header)
        if pusher is None:
            dist.broadcast(tokens, src=0)

    def call(self, target: str, *args) -> list:
        """Run `module:function(engine, *args)` on every follower; their results in rank
        order (rank 0 runs its own part itself)."""
        msg = _CALL + pickle.dumps((target, args))
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
                c.send_bytes(_STOP)
            except (OSError, EOFError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
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
    env = dict(os.environ, DUET_TP_ADDR="%s:%d" % listener.address, DUET_TP_KEY=key.hex(),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = [subprocess.Popen([sys.executable, "-c", _FOLLOWER_BOOT], env=env) for _ in range(1, tp_size)]
    conns: list = [None] * (tp_size - 1)
    workers = TPWorkers(procs, conns)
    try:
        for rank in range(1, tp_size):
            conn = _accept(listener, procs)
            conn.send((rank, tp_size, init, replace(config, tp=TPContext())))
            conns[rank - 1] = conn
        listener.close()
        dist.init_process_group(_backend_for(device), init_method=init, rank=0, world_size=tp_size,
                                timeout=INIT_TIMEOUT)
    except BaseException:
        listener.close()
        workers.conns = [c for c in conns if c is not None]
        workers.shutdown(timeout=5)
        raise
    return TPContext(rank=0, size=tp_size, group=dist.group.WORLD), workers


_FOLLOWER_BOOT = "from shared.engine.tp_launcher import follower_entry; follower_entry()"


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


def follower_entry() -> None:
    """Run in a follower interpreter: connect to rank 0, then follower_main."""
    host, port = os.environ["DUET_TP_ADDR"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["DUET_TP_KEY"]))
    rank, size, init, config = conn.recv()
    follower_main(rank, size, init, config, conn)


def follower_main(rank: int, size: int, init: str, config, conn) -> None:
    """Rank > 0: build the engine shard, then run every step rank 0 sends."""
    engine = None
    try:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = config.resolve_device()  # rank-independent here; the engine offsets by rank
        if device.type == "cuda":
            torch.cuda.set_device(torch.device("cuda", (device.index or 0) + rank))
        dist.init_process_group(_backend_for(device), init_method=init, rank=rank, world_size=size,
                                timeout=INIT_TIMEOUT)
        config.tp = TPContext(rank=rank, size=size, group=dist.group.WORLD)
        from .engine import Engine
        engine = Engine(config)
        conn.send_bytes(pickle.dumps(("ready", None)))
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        finally:
            os._exit(1)
    try:
        _follow(engine, conn)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


IDLE_TICK_S = 0.002  # while rank 0 sends nothing: how often rank services (KV transfer) progress


def _follow(engine, conn) -> None:
    while True:
        try:
            if engine.rank_services and not conn.poll(IDLE_TICK_S):
                for service in list(engine.rank_services.values()):
                    service.idle_tick()
                continue
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return  # rank 0 is gone
        kind = msg[:4]
        if kind == _FORWARD:
            plan = StepPlan(np.frombuffer(msg, dtype=np.int32, offset=4).copy())
            engine.runner.forward_plan(plan)
        elif kind == _SAMPLED:
            start, n, epoch = np.frombuffer(msg, dtype=np.int64, offset=4).tolist()
            if epoch:  # rank 0's device writes our ring; the next forward waits for it
                engine.tp.custom_all_reduce.wait_tokens(epoch)
                continue
            ring = engine.runner.future_tokens
            tokens = torch.empty(n, dtype=ring.dtype, device=ring.device)
            dist.broadcast(tokens, src=0)
            ring[start:start + n].copy_(tokens)
        elif kind == _CALL:
            target, args = pickle.loads(msg[4:])
            try:
                reply = ("ok", _resolve(target)(engine, *args))
            except Exception:  # noqa: BLE001 - reported to rank 0
                reply = ("error", traceback.format_exc())
            conn.send_bytes(pickle.dumps(reply))
        elif kind == _STOP:
            return
