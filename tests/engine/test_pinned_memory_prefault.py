"""The host tier's background page-locking faults each chunk in before registering it
(shared/engine/pinned_memory.py): faulting takes no lock of CUDA's, so the registration, which
holds the driver's lock every kernel launch waits on, finds the pages already present. The
registration is a stand-in that asks the kernel (mincore) how much of its chunk is resident at
the moment it is called; the buffer and the faulting are real."""
from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from shared.engine import pinned_memory
from shared.engine.pinned_memory import BackgroundPinner, aligned_empty

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_share(ptr: int, size: int) -> float:
    pages = -(-size // PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(ptr, size, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


class ResidencyAtRegistration:
    def __init__(self):
        self.shares: list[float] = []

    def register(self, ptr: int, size: int, flags: int) -> int:
        self.shares.append(resident_share(ptr, size))
        return 0

    def unregister(self, ptr: int) -> int:
        return 0


def untouched(nbytes: int) -> torch.Tensor:
    """Fresh anonymous memory, as a host tier of GiBs always is (glibc maps allocations that
    large on their own; a small one here could come back from the heap already touched)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8)


def lock(buf: torch.Tensor) -> ResidencyAtRegistration:
    seen = ResidencyAtRegistration()
    pinner = BackgroundPinner(buf, torch.device("cpu"), PAGE, chunk_bytes=1 << 20,
                              register=(seen.register, seen.unregister))
    assert pinner.wait(30) and not pinner.failed, pinner.failed
    return seen


def test_each_chunk_is_resident_before_its_registration():
    buf = untouched(16 << 20)  # its pages are not there yet
    assert resident_share(buf.data_ptr(), 1 << 20) < 0.5
    seen = lock(buf)
    assert len(seen.shares) == 16 and min(seen.shares) == 1.0, seen.shares


def test_without_the_call_the_registration_gets_the_pages_as_they_are(monkeypatch):
    """A kernel without MADV_POPULATE_WRITE (before 5.14): the locking goes on, the registration
    faulting the pages in itself, as it did before."""
    monkeypatch.setattr(pinned_memory, "MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel knows: EINVAL
    buf = untouched(8 << 20)
    assert resident_share(buf.data_ptr(), 8 << 20) < 0.5
    seen = lock(buf)
    assert len(seen.shares) == 8 and max(seen.shares) < 0.5, seen.shares


@pytest.fixture(autouse=True)
def populate_write_known():
    buf = aligned_empty((PAGE,), torch.uint8)
    if libc.madvise(ctypes.c_void_p(buf.data_ptr()), PAGE, 23) != 0:
        pytest.fail(f"this kernel has no MADV_POPULATE_WRITE (errno {ctypes.get_errno()}): Linux 5.14+ has")
