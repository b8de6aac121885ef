"""Engine settings: one dataclass, filled by the offline API, the CLI and the workers."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .parallel import TPContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
CPU_DEFAULT_KV_BYTES = 1 << 30  # absolute on CPU: several workers share one small machine


@dataclass
class EngineConfig:
    model_dir: str | None = None  # None: the embedded default model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (| float64 for tests)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    page_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: CPU default or GPU fraction
    # host-memory tier under the device KV pool (kv_host_tier.py), bytes; None: on a GPU
    # twice the device KV budget, at most a quarter of the host's available memory; off on
    # the CPU (its device pool is host memory already); 0: off
    kv_host_memory: int | None = None
    mem_fraction: float = 0.85  # GPU: share of total memory for weights + KV (+ graphs)
    max_num_batched_tokens: int | None = None  # per-step token budget (chunked prefill)
    max_running_requests: int = 256
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"  # auto | torch | triton | flashinfer
    cuda_graph: bool = True
    cuda_graph_max_bs: int = 256
    # CPU prepares step N+1 while the device runs step N (overlap.py). None: on, except with
    # TP on GPUs without the custom all-reduce (the tokens would need an NCCL broadcast a step);
    # with it, 2 x H200, Qwen3-8B shape, TP=2: 3.54 / 4.55 ms at B=1 / 32 vs 4.09 / 5.51 plain
    overlap_schedule: bool | None = None
    num_threads: int | None = None  # torch intra-op threads on CPU
    tp_size: int = 1  # tensor-parallel ranks (processes); this process is rank 0
    ep_size: int = 1  # MoE: 1 (experts sliced over the TP ranks) or tp_size (experts split whole)
    custom_all_reduce: bool = True  # TP on GPU: one-shot P2P all-reduce fused with add+RMSNorm
    # fused: one launch that pushes, signals with in-kernel flags, sums and does add+RMSNorm;
    # barrier: the same sum between two torch symm-mem barriers; oneshot: torch's
    # one-launch copy+sync+sum, then add+RMSNorm (custom_all_reduce.py)
    custom_all_reduce_mode: str = field(default_factory=lambda: os.environ.get("DUET_CUSTOM_ALLREDUCE", "fused"))
    # decode-size linears (<= 16 rows, bf16/fp16, GPU) through the split-K Triton kernel
    # (kernels/small_batch_linear.py) instead of cuBLAS: "auto" (default: the LM head, which it
    # won on H100 and H200, and every linear whose shape and batch this GPU's sweep tuned, i.e.
    # where it beat cuBLAS), "lm_head", "all", or "off"
    small_batch_linear: str = field(default_factory=lambda: os.environ.get("DUET_SMALL_BATCH_LINEAR", "auto"))
    # programmatic dependent launch for the batch-1 decode kernels (kernels/pdl.py; Hopper+):
    # "on" (default; where the GPU and Triton have it) or "off"; the small-batch linears
    # prefetch this many weight tiles into L2 while the kernel before them finishes
    pdl: str = field(default_factory=lambda: os.environ.get("DUET_PDL", "on"))
    pdl_prefetch_k_blocks: int = field(default_factory=lambda: int(os.environ.get("DUET_PDL_PREFETCH", "1")))
    # per-linear depths that replace it, by attribute name: "o_proj=8,qkv_proj=2"
    pdl_prefetch_at: str = field(default_factory=lambda: os.environ.get("DUET_PDL_PREFETCH_AT", ""))
    load_format: str = "auto"  # auto: safetensors | dummy: random weights (benchmarks)
    # speculative decoding (shared/engine/speculative/): None (off), "ngram" (drafts copied
    # from the request's own tokens), "draft" (a smaller model with the target's tokenizer)
    # or "eagle3" (an EAGLE-3 head over the target's hidden states)
    speculative_method: str | None = None
    speculative_tokens: int = 4  # draft tokens per verify step (K; the verify computes K + 1)
    speculative_draft_model: str | None = None  # folder of the draft model or EAGLE-3 head
    # n-gram lookup: the longest suffix of max..min tokens that occurred before proposes
    # what followed it
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 4
    # step aside: no speculation above this many decoding sequences (None: the measured
    # default, speculative/policy.py), nor for a request whose recent accepted tokens per
    # draft token fall below the threshold (it tries again after a cool-down)
    speculative_max_batch: int | None = None
    speculative_min_acceptance: float = 0.2
    # benchmarks only (never served): every draft token counts as accepted, whatever the
    # target says; gives the bound of a method's speed-up
    speculative_accept_all: bool = False
    tp: TPContext = field(default_factory=TPContext)  # this process's rank (set by the engine)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            dev = torch.device(self.device)
        if dev.type == "cuda":  # an explicit index (set_device needs one); rank r takes the r-th GPU
            dev = torch.device("cuda", (dev.index or 0) + self.tp.rank)
        return dev

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, float32, bfloat16 or float16")
        if self.dtype == "float64" and device.type == "cuda":  # the Triton kernels have no fp64 variants
            raise ValueError("dtype float64 runs on the CPU only (device='cpu'); on a GPU choose float32, "
                             "bfloat16 or float16")
        return DTYPES[self.dtype]

    def resolve_batched_tokens(self, device: torch.device) -> int:
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        return 8192 if device.type == "cuda" else 1024
