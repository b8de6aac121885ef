"""Run a `kernels` function where its Triton code can run.

On CUDA the function is called in this process. Without CUDA it is called in a
child process started with TRITON_INTERPRET=1: Triton fixes interpreter mode
when `triton` is first imported, so the child must set it before any import,
and keeping the variable out of this process means other code here (backend
selection through `triton_available()`) is not switched to the interpreter.

Tensors travel through torch's shared-memory pickler, so views keep their
strides and storage sharing, and in-place writes made by the child are seen by
the caller's tensors.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers shared-memory tensor pickling)


def _resolve(target: str):
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _child_loop(conn) -> None:
    # TRITON_INTERPRET is already in this process's environment (set at spawn).
    torch.set_num_threads(1)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        target, args, kwargs = msg
        try:
            result = _resolve(target)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # report every failure to the caller
            conn.send(("error", traceback.format_exc()))


@dataclass
class KernelRunner:
    """Calls `module:function` targets natively on CUDA or interpreted on CPU."""

    use_cuda: bool = field(default_factory=torch.cuda.is_available)
    _proc: Any = None
    _conn: Any = None

    @property
    def device(self) -> torch.device:
        return torch.device("cuda" if self.use_cuda else "cpu")

    def _start_child(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the spawned child only
        try:
            self._proc = ctx.Process(target=_child_loop, args=(child,), daemon=True)
            self._proc.start()
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
        child.close()
        self._conn = parent

    def __call__(self, target: str, *args, **kwargs):
        if self.use_cuda:
            out = _resolve(target)(*args, **kwargs)
            torch.cuda.synchronize()
            return out
        if self._proc is None:
            self._start_child()
        self._conn.send((target, args, kwargs))
        status, payload = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"{target} failed in the interpreter child:\n{payload}")
        return payload

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._conn.send(None)
                self._proc.join(timeout=10)
            finally:
                if self._proc.is_alive():
                    self._proc.kill()
                self._proc = None
                self._conn = None
