"""Page-locked host memory of exactly the size asked for, locked in the background.

torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of two so
that its cached blocks can be reused: a 40 GiB host KV tier locks 64 GiB and an 81 GiB one
128 GiB, and a few workers sized to share a host's memory then run it out (the kernel's OOM
killer ends one of them: `duet up --prefill-tp 2 --decode-tp 1` on a 256 GiB host did). Here
the tensor is ordinary host memory, registered with CUDA (cudaHostRegister, as SGLang's host
KV pool does) at its own size, and unregistered when the tensor is collected.

Locking touches every page of it (a minute for a few hundred GiB), so `BackgroundPinner`
registers it chunk by chunk on a thread of its own, only while its engine says it may: after
the engine's graphs are captured and while no step has run for a moment (Engine._may_pin). A
registration holds a driver lock that every kernel launch and graph capture of the process
waits on: on 2 x H200 an 8B worker's graph capture (5 s alone) took 25-58 s beside the
locking of a 25-50 GiB tier, ending just after it every time, with 1 GiB or 64 MiB chunks and a
2 ms pause between them. `pinned_bytes` grows as it goes, and the host tier hands out only
pages already locked (a copy through pageable memory would make the step that queued it
wait); under load from the first second the tier grows in the gaps between steps, and while
steps run without a gap by a chunk whenever that keeps the registrations' share of the time at
BUSY_SHARE (a registration of ~15 ms: one every half second): a faster registration, a faster
growing tier at the same cost to the steps. The registration is called through ctypes into the CUDA
runtime torch loaded, which releases the GIL, so the engine thread runs meanwhile; torch's own
binding (which holds it) is the fallback.

Each chunk is faulted in before its turn (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14+), which
takes no driver lock and needs no gate: the registration then pins pages that are already
there. On a 2-core VM, locking fresh 4 KiB pages took 4.9-5.3 ms per 16 MiB, of which faulting
them in was 5.0 and locking them once present 1.5 (mlock, the kernel's half of a registration;
`docs/performance/serving.md`); how much of a registration's ~12 ms on a GPU host that is, is
not measured. Where the call is missing the registration faults the pages itself, as before."""
from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading
import time
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# locked at a time; a copy run never crosses a chunk (kv_copy_lane.page_runs). A step that starts
# while a chunk is being locked waits for it (the driver's lock), so chunks are small: 16 MiB is
# ~15 ms of locking; copy runs of 2 MiB already reach ~51 GB/s on these machines
CHUNK_BYTES = 16 << 20
YIELD_S = 0.002  # between chunks: a launch waiting on the driver's lock gets in
WAIT_S = 0.01  # how often a pinner held back asks again
STOP_WAIT_S = 5.0  # stop(): a chunk's registration takes milliseconds
BUSY_SHARE = 0.03  # serving without a pause: registrations hold the driver's lock this share of the time
PORTABLE = 1  # cudaHostRegisterPortable: locked for every context, whichever thread registers it
OS_PAGE = mmap.PAGESIZE  # chunks start on OS pages (64 KiB on some arm64 kernels): two registrations
# sharing a page would refuse the second, and madvise wants a page-aligned start
ALIGN = 2 << 20  # the buffer starts on a huge-page boundary
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL and the registration faults pages in


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor whose first byte is ALIGN-aligned (torch's CPU allocator
    aligns to 64 bytes only)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + nbytes].view(dtype).view(shape)


def _populate_write():
    """madvise(MADV_POPULATE_WRITE) of libc (pages made present and writable, no lock of
    CUDA's), or None where libc lacks madvise."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lambda ptr, size: madvise(ptr, size, MADV_POPULATE_WRITE) == 0


def _cudart_register():
    """cudaHostRegister / cudaHostUnregister of the CUDA runtime torch loaded, via ctypes
    (the GIL released during the call); torch's binding when that library is not found."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        lib = ctypes.CDLL(sorted(paths)[0])
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        return lib.cudaHostRegister, lib.cudaHostUnregister
    except (OSError, IndexError, AttributeError):
        cudart = torch.cuda.cudart()
        return (lambda ptr, size, flags: int(cudart.cudaHostRegister(ptr, size, flags))), cudart.cudaHostUnregister


def busy_hold_s(registration_s: float) -> float:
    """How long a pinner held back by steps that never pause waits before it takes the next
    chunk anyway: the last registration's time over BUSY_SHARE (a 15 ms one: 0.5 s), so the
    registrations hold the driver's lock that share of the time, however long one takes."""
    return registration_s / BUSY_SHARE


class BackgroundPinner:
    """Page-locks `tensor` chunk by chunk on a thread of its own (chunks of whole `unit`s:
    a host page's bytes). `pinned_bytes` only grows; `done` is set when it stops, `failed`
    then says why it stopped short (a memlock limit: the rest stays out of use)."""

    def __init__(self, tensor: torch.Tensor, device: torch.device, unit: int, chunk_bytes: int = CHUNK_BYTES,
                 may_pin: Callable[[], bool] | None = None, register=None):
        """may_pin(): whether the next chunk may be locked now (None: always); register: the
        (cudaHostRegister, cudaHostUnregister) pair (default: the CUDA runtime's, _cudart_register)."""
        self.may_pin = may_pin
        self._register = register
        self._stop = threading.Event()
        self.tensor = tensor
        self.device = device
        self.nbytes = tensor.numel() * tensor.element_size()
        step = math.lcm(unit, OS_PAGE)  # whole host pages, starting on OS pages
        self.chunk_bytes = max(step, chunk_bytes // step * step)
        self.pinned_bytes = 0
        self.failed = ""
        self.done = threading.Event()
        self.seconds = 0.0
        self.last_registration_s = 0.0
        threading.Thread(target=self._run, name="host-tier-pinning", daemon=True).start()

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            register, unregister = self._register or _cudart_register()
            populate = _populate_write()
            base = self.tensor.data_ptr()
            while self.pinned_bytes < self.nbytes:
                size = min(self.chunk_bytes, self.nbytes - self.pinned_bytes)
                if populate is not None and not populate(base + self.pinned_bytes, size):
                    populate = None  # not this kernel (or no room): the registration faults them in
                self._wait_turn()
                if self._stop.is_set():
                    self.failed = "stopped: its engine closed"
                    break
                began = time.monotonic()
                err = register(base + self.pinned_bytes, size, PORTABLE)
                self.last_registration_s = time.monotonic() - began
                if int(err) != 0:
                    self.failed = f"cudaHostRegister: error {int(err)}"
                    break
                weakref.finalize(self.tensor, unregister, base + self.pinned_bytes)
                self.pinned_bytes += size
                time.sleep(YIELD_S)
        except Exception as exc:  # noqa: BLE001 - the tier keeps what got locked; the log says why
            self.failed = f"{type(exc).__name__}: {exc}"
        finally:
            self.seconds = time.monotonic() - t0
            if self._stop.is_set():
                log.info("host KV tier: page-locking stopped at %.2f of %.2f GiB (its engine closed)",
                         self.pinned_bytes / 2**30, self.nbytes / 2**30)
            elif self.failed:
                log.warning("host KV tier: page-locked %.2f of %.2f GiB in %.1fs, then %s; the rest stays unused "
                            "(a copy through pageable memory would make a step wait)", self.pinned_bytes / 2**30,
                            self.nbytes / 2**30, self.seconds, self.failed)
            else:
                log.info("host KV tier: %.2f GiB page-locked in the background in %.1fs", self.nbytes / 2**30,
                         self.seconds)
            self.done.set()

    def _wait_turn(self) -> None:
        """Until may_pin() allows the next chunk; once the first is locked, at most busy_hold_s
        of the last registration (busy for long: one chunk anyway, so the tier still grows)."""
        if self.may_pin is None:
            return
        until = time.monotonic() + (busy_hold_s(self.last_registration_s) if self.pinned_bytes else float("inf"))
        while not self.may_pin() and time.monotonic() < until and not self._stop.is_set():
            time.sleep(WAIT_S)

    def stop(self, wait_s: float = STOP_WAIT_S) -> bool:
        """Lock no further chunk (the engine closed: a thread left running would keep the buffer,
        tens of GiB, alive and go on locking it), and wait up to wait_s for the thread to end: until
        it does it holds may_pin, so its engine, whose GPU memory the caller's collection right after
        close() would otherwise miss (`duet bench`'s next engine, or a worker started beside it,
        then found the card full). What is locked stays until the tensor is collected."""
        self._stop.set()
        if self.done.wait(wait_s):
            return True
        log.warning("host KV tier: the page-locking thread did not stop within %.1fs", wait_s)
        return False

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)
