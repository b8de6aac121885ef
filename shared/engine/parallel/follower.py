"""Tensor parallelism, the followers' side: ranks 1..N-1, each a fresh interpreter started
by launcher.py (FOLLOWER_BOOT). A follower connects back to rank 0, builds the same Engine
on its own shard and device, then runs every step rank 0 sends down the control pipe
(control.py) until rank 0 says stop or is gone."""
from __future__ import annotations

import importlib
import os
import pickle
import sys
import threading
import traceback
from multiprocessing.connection import Client

import numpy as np
import torch
import torch.distributed as dist

from shared.process_exit import FastExit
from shared.settings.process_vars import TP_ADDR, TP_KEY

from ..step_plan import StepPlan
from . import control
from .context import TPContext

IDLE_TICK_S = 0.002  # while rank 0 sends nothing: how often rank services (KV transfer) progress
LEAVE_GROUP_S = 10.0  # how long leaving the process group may take before the follower just exits


def follower_entry(fast_exit: FastExit) -> None:
    """Run in a follower interpreter: connect to rank 0, then follower_main; once told to stop,
    exit without the interpreter's teardown (rank 0 waits for this process to end).
    fast_exit: installed by FOLLOWER_BOOT before torch was imported (shared/process_exit.py)."""
    host, port = os.environ[TP_ADDR.name].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[TP_KEY.name]))
    rank, size, init, config = conn.recv()
    follower_main(rank, size, init, config, conn)
    fast_exit.code = 0


def follower_main(rank: int, size: int, init: str, config, conn) -> None:
    """Rank > 0: build the engine shard, then run every step rank 0 sends."""
    engine = None
    try:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = config.resolve_device()  # rank-independent here; the engine offsets by rank
        if device.type == "cuda":
            torch.cuda.set_device(torch.device("cuda", (device.index or 0) + rank))
        dist.init_process_group(control.backend_for(device), init_method=init, rank=rank, world_size=size,
                                timeout=control.INIT_TIMEOUT)
        config.tp = TPContext(rank=rank, size=size, group=dist.group.WORLD)
        from ..engine import Engine  # here, so a failing import reaches rank 0 like any start-up error
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
        _leave_group(LEAVE_GROUP_S)


def _leave_group(timeout: float) -> None:
    """destroy_process_group, bounded. On GPUs a follower told to stop was seen not to exit for
    30 s (rank 0 then killed it; why is not known yet: docs/performance/tp.md). The process
    is exiting anyway: past the bound it exits without leaving the group."""
    if not dist.is_initialized():
        return
    leaving = threading.Thread(target=dist.destroy_process_group, daemon=True)
    leaving.start()
    leaving.join(timeout)
    if leaving.is_alive():
        print(f"TP follower: leaving the process group took over {timeout:.0f}s; exiting without it",
              file=sys.stderr, flush=True)
        os._exit(0)


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
        if kind == control.FORWARD:
            plan = StepPlan(np.frombuffer(msg, dtype=np.int32, offset=4).copy())
            engine.runner.forward_plan(plan)
        elif kind == control.SAMPLED:
            start, n, epoch = np.frombuffer(msg, dtype=np.int64, offset=4).tolist()
            if epoch:  # rank 0's device writes our ring; the next forward waits for it
                engine.tp.custom_all_reduce.wait_tokens(epoch)
                continue
            ring = engine.runner.future_tokens
            tokens = torch.empty(n, dtype=ring.dtype, device=ring.device)
            dist.broadcast(tokens, src=0)
            ring[start:start + n].copy_(tokens)
        elif kind == control.CALL:
            target, args = pickle.loads(msg[4:])
            try:
                reply = ("ok", _resolve(target)(engine, *args))
            except Exception:  # noqa: BLE001 - reported to rank 0
                reply = ("error", traceback.format_exc())
            conn.send_bytes(pickle.dumps(reply))
        elif kind == control.STOP:
            return


def _resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
