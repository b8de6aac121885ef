"""What the kernel tests share: the dtypes they cover (all three on CUDA; float32 on CPU,
where the Triton interpreter's bf16 dot is wrong and fp16 is slow), a per-case seeded
generator, and relative-error bounds against the float references."""
from __future__ import annotations

import zlib

import torch

CUDA = torch.cuda.is_available()


def kernel_dtypes(fp16: bool = True) -> list[torch.dtype]:
    if not CUDA:
        return [torch.float32]
    return [torch.bfloat16] + ([torch.float16] if fp16 else []) + [torch.float32]


# attention accumulates over a whole context; element-wise kernels (norms, rotary) round once
ATTENTION_TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}
ELEMENTWISE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def case_generator(*params) -> torch.Generator:
    """A CPU generator seeded from the case's parameters: fresh data per case, and a failure reproduces."""
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))
