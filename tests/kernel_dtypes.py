"""The dtypes the kernel tests cover: all three on CUDA; float32 on CPU (the Triton
interpreter's bf16 dot is wrong, and fp16 is slow there)."""
from __future__ import annotations

import torch

CUDA = torch.cuda.is_available()


def kernel_dtypes(fp16: bool = True) -> list[torch.dtype]:
    if not CUDA:
        return [torch.float32]
    return [torch.bfloat16] + ([torch.float16] if fp16 else []) + [torch.float32]
