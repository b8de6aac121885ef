"""Page-locked host memory of exactly the size asked for, locked in the background.

torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of two so
that its cached blocks can be reused: a 40 GiB host KV tier locks 64 GiB and an 81 GiB one
128 GiB, and a few workers sized to share a host's memory then run it out (the kernel's OOM
killer ends one of them: `duet up --prefill-tp 2 --decode-tp 1` on a 256 GiB host did). Here
the tensor is ordinary host memory, registered with CUDA (cudaHostRegister, as SGLang's host
KV pool does) at its own size, and unregistered when the tensor is collected.

Locking touches every page of it (a minute for a few hundred GiB), so `BackgroundPinner`
registers it chunk by chunk on a thread of its own while the worker warms up and serves:
`pinned_bytes` grows as it goes, and the host tier hands out only pages already locked (a
copy through pageable memory would make the step that queued it wait). The registration is
called through ctypes into the CUDA runtime torch loaded, which releases the GIL, so the
engine thread runs meanwhile; torch's own binding (which holds it) is the fallback."""
from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
import weakref

import torch

log = logging.getLogger(__name__)

# locked at a time; a copy run never crosses a chunk (kv_copy_lane.page_runs). Between chunks the
# thread sleeps a moment: a registration holds a lock of the driver's, and a thread released and
# taking it again at once starves the others. On two H200s an 8B worker's graph capture (a few
# seconds of work) ended just after the locking of a 25-62 GiB tier every time, 26-62 s, with 1
# GiB and with 64 MiB chunks alike (docs/performance/serving.md, "Start-up beside the host
# tier"); small chunks bound each wait, the pause lets the waiter in: since then an 8B decode
# worker's graphs took 6.7 s. A registration during a graph capture is safe only because the
# capture runs in thread_local mode (cuda_graph.capture_graph)
CHUNK_BYTES = 64 << 20
YIELD_S = 0.002  # between chunks: ~2 s over 62 GiB
PORTABLE = 1  # cudaHostRegisterPortable: locked for every context, whichever thread registers it
OS_PAGE = 4096  # chunks start on OS pages: two registrations sharing a page would refuse the second
ALIGN = 2 << 20  # the buffer starts on a huge-page boundary


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor whose first byte is ALIGN-aligned (torch's CPU allocator
    aligns to 64 bytes only)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + nbytes].view(dtype).view(shape)


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


class BackgroundPinner:
    """Page-locks `tensor` chunk by chunk on a thread of its own (chunks of whole `unit`s:
    a host page's bytes). `pinned_bytes` only grows; `done` is set when it stops, `failed`
    then says why it stopped short (a memlock limit: the rest stays out of use)."""

    def __init__(self, tensor: torch.Tensor, device: torch.device, unit: int, chunk_bytes: int = CHUNK_BYTES):
        self.tensor = tensor
        self.device = device
        self.nbytes = tensor.numel() * tensor.element_size()
        step = math.lcm(unit, OS_PAGE)  # whole host pages, starting on OS pages
        self.chunk_bytes = max(step, chunk_bytes // step * step)
        self.pinned_bytes = 0
        self.failed = ""
        self.done = threading.Event()
        self.seconds = 0.0
        threading.Thread(target=self._run, name="host-tier-pinning", daemon=True).start()

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            register, unregister = _cudart_register()
            base = self.tensor.data_ptr()
            while self.pinned_bytes < self.nbytes:
                size = min(self.chunk_bytes, self.nbytes - self.pinned_bytes)
                err = register(base + self.pinned_bytes, size, PORTABLE)
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
            if self.failed:
                log.warning("host KV tier: page-locked %.2f of %.2f GiB in %.1fs, then %s; the rest stays unused "
                            "(a copy through pageable memory would make a step wait)", self.pinned_bytes / 2**30,
                            self.nbytes / 2**30, self.seconds, self.failed)
            else:
                log.info("host KV tier: %.2f GiB page-locked in the background in %.1fs", self.nbytes / 2**30,
                         self.seconds)
            self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)
