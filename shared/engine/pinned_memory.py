"""Page-locked host memory of exactly the size asked for.

torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of two so
that its cached blocks can be reused: a 40 GiB host KV tier locks 64 GiB and an 81 GiB one
128 GiB, and a few workers sized to share a host's memory then run it out (the kernel's OOM
killer ends one of them: `duet up --prefill-tp 2 --decode-tp 1` on a 256 GiB host did). Here
the tensor is ordinary host memory, registered with CUDA (cudaHostRegister, as SGLang's host
KV pool does) at its own size, and unregistered when the tensor is collected."""
from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, page-locked for asynchronous copies to and from the
    GPU. If CUDA refuses to lock it (a memlock limit), it stays pageable (copies through it
    are slower, not wrong) and a warning says so."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        log.warning("could not page-lock %.2f GiB of host memory (cudaHostRegister: %s); copies through it "
                    "will be slower", nbytes / 2**30, err)
        return t
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t
