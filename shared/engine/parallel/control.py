"""What rank 0 (launcher.py) and its followers (follower.py) agree on: the kinds of message
on the control pipe and how they join the process group.

Each message is one `send_bytes` payload whose first four bytes say its kind:
  FORWARD  + a packed StepPlan (int32): run this step's forward
  SAMPLED  + [start, n, epoch] (int64): this step's sampled tokens for the ring slots
           [start, start+n); epoch > 0 means rank 0's device pushes them (custom all-reduce)
  CALL     + pickle((target, args)): run `module:function(engine, *args)`, reply pickled
  STOP     the follower returns"""
from __future__ import annotations

from datetime import timedelta

import torch

FORWARD, CALL, STOP, SAMPLED = b"F\0\0\0", b"C\0\0\0", b"S\0\0\0", b"T\0\0\0"
INIT_TIMEOUT = timedelta(minutes=10)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
