"""Messages between a pool and its helper: a 4-byte length, then a pickle. Both ends are our
own code (the helper only ever runs functions the parent names), so pickle is fine here."""
from __future__ import annotations

import os
import pickle
import select
import struct
import time
from typing import Any, BinaryIO

HEADER = struct.Struct("!I")


class FrameTimeout(TimeoutError):
    pass


def encode(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def write_frame(stream: BinaryIO, obj: Any) -> None:
    stream.write(encode(obj))
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    """The next message (blocking); EOFError when the other end closed."""
    head = _read_exact(stream, HEADER.size)
    return pickle.loads(_read_exact(stream, HEADER.unpack(head)[0]))


def read_frame_before(fd: int, deadline: float) -> Any:
    """The next message from a pipe's fd, or FrameTimeout at `deadline` (time.monotonic)."""
    head = _read_fd(fd, HEADER.size, deadline)
    return pickle.loads(_read_fd(fd, HEADER.unpack(head)[0], deadline))


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("the other end closed the pipe")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_fd(fd: int, n: int, deadline: float) -> bytes:
    parts, left = [], n
    while left:
        wait = deadline - time.monotonic()
        if wait <= 0:
            raise FrameTimeout()
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            raise FrameTimeout()
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the helper process closed its pipe")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)
