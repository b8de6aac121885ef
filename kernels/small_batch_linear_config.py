"""Tilings for kernels.small_batch_linear: per-GPU tables of per-shape tilings (from a sweep on
that GPU, as SGLang and vLLM keep per-device config files; docs/performance/kernels.md says how
they were made and how to redo one) and a heuristic for other shapes.

A config is looked up by the GPU (gpu_key: "H100", "H200", ...), the weight's shape (N rows,
K columns; for the fused gate/up kernel N is 2I, the stacked weight's rows), whether it is
the gate/up kernel, and the batch rounded up to an M bucket. A tuned entry is also where the
sweep found the kernel faster than cuBLAS: the engine's default ("auto") routes a linear
here only then (and always the LM head). Pure Python: no triton import.
"""

from __future__ import annotations

from dataclasses import dataclass

M_BUCKETS = (1, 2, 4, 8, 16)
MAX_M = M_BUCKETS[-1]
# FP8 weights (W8A16) can run here up to 32 rows: past 16 rows cuBLAS wins for 16-bit weights, but
# an FP8 weight's alternative is quantizing the activations for a W8A8 GEMM, which costs as much as
# this kernel saves at 32 rows; at 64 the x tiles it re-reads from L2 for every N tile cost more
# than the weights. (kernels/fp8_linear.py routes 2..32 rows to the FP8 decode GEMM where Hopper
# runs it.)
FP8_M_BUCKETS = M_BUCKETS + (32,)
FP8_MAX_M = FP8_M_BUCKETS[-1]
PARTIAL_FLOATS = 1 << 22  # split-K scratch a workspace holds by default (small_batch_linear.SmallBatchWorkspace)


@dataclass(frozen=True)
class SmallBatchConfig:
    """One program computes BLOCK_N outputs (per gate/up half) over one of split_k K ranges."""

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1  # >1: fp32 partials, the last-arriving program of a tile reduces them in split order
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True  # tensor-core dot (x padded to 16 rows) or CUDA-core multiply + sum
    # FP8 weights, tensor-core path, 16-bit x: widen the weight tile to fp16 with x scaled per row
    # (kernels/triton_small_batch_linear.py) instead of to x's dtype; faster only where x's tile
    # is shared (the fused gate/up), since x's per-row scaling is paid every K step
    widen_f16: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


@dataclass(frozen=True)
class ShapeKey:
    n: int  # weight rows (2I for gate/up)
    k: int
    gate_up: bool = False


def m_bucket(m: int, fp8: bool = False) -> int:
    buckets = FP8_M_BUCKETS if fp8 else M_BUCKETS
    if not 1 <= m <= buckets[-1]:
        raise ValueError(f"small_batch_linear handles 1..{buckets[-1]} rows{' (FP8 weights)' if fp8 else ''}, got {m}")
    return next(b for b in buckets if b >= m)


def _c(block_n, block_k, split_k, num_warps=4, num_stages=3, use_dot=True, widen_f16=False) -> SmallBatchConfig:
    return SmallBatchConfig(block_n, block_k, split_k, num_warps, num_stages, use_dot, widen_f16)


# The sweep's winners over cuBLAS, bf16, Qwen3-8B shapes (the GPU's own sweep, L2 cold): at M=1 the
# CUDA-core path with one stage wins on every shape; other buckets fall back to the heuristic.
TUNED_H100: dict[ShapeKey, dict[int, SmallBatchConfig]] = {
    ShapeKey(6144, 4096): {1: _c(16, 256, 2, 4, 1, False)},  # qwen3-8b qkv (M=8: cuBLAS wins)
    ShapeKey(4096, 4096): {1: _c(16, 256, 3, 4, 1, False), 8: _c(32, 256, 5, 4, 2, True)},  # qwen3-8b o
    ShapeKey(24576, 4096): {1: _c(16, 512, 1, 4, 1, False), 8: _c(32, 512, 1, 4, 3, True)},  # qwen3-8b gate_up
    ShapeKey(24576, 4096, True): {1: _c(16, 512, 1, 8, 1, False), 8: _c(32, 256, 1, 4, 3, True)},  # gate_up+SwiGLU
    ShapeKey(4096, 12288): {1: _c(16, 256, 3, 4, 1, False), 8: _c(64, 128, 9, 4, 2, True)},  # qwen3-8b down
    ShapeKey(151936, 4096): {1: _c(16, 512, 1, 8, 1, False), 8: _c(64, 256, 1, 4, 3, True)},  # qwen3-8b lm_head
}

# The same sweep on the other GPU, Qwen3-30B-A3B's shapes too (its qkv lost: cuBLAS keeps it).
TUNED_H200: dict[ShapeKey, dict[int, SmallBatchConfig]] = {
    ShapeKey(6144, 4096): {1: _c(16, 256, 2, 4, 1, False)},  # qwen3-8b qkv
    ShapeKey(4096, 4096): {1: _c(16, 256, 2, 4, 1, False), 8: _c(32, 256, 5, 4, 2, True)},  # qwen3-8b o
    ShapeKey(24576, 4096): {1: _c(64, 128, 1, 4, 3, True), 8: _c(64, 128, 1, 4, 3, True)},  # qwen3-8b gate_up
    ShapeKey(24576, 4096, True): {1: _c(64, 128, 1, 4, 3, True), 8: _c(64, 128, 1, 4, 3, True)},  # gate_up+SwiGLU
    ShapeKey(4096, 12288): {1: _c(16, 256, 3, 4, 1, False), 8: _c(64, 128, 9, 4, 2, True)},  # qwen3-8b down
    ShapeKey(151936, 4096): {1: _c(32, 256, 1, 8, 1, False), 8: _c(64, 128, 1, 4, 3, True)},  # qwen3-8b lm_head
    ShapeKey(2048, 4096): {1: _c(32, 512, 4, 4, 1, False), 8: _c(32, 256, 8, 4, 2, True)},  # qwen3-30b-a3b o
    ShapeKey(128, 2048): {1: _c(16, 256, 8, 8, 1, False), 8: _c(16, 256, 8, 4, 3, True)},  # qwen3-30b-a3b router
    ShapeKey(151936, 2048): {1: _c(64, 128, 1, 4, 3, True), 8: _c(64, 128, 1, 4, 3, True)},  # 30b-a3b lm_head
}

TUNED: dict[str, dict[ShapeKey, dict[int, SmallBatchConfig]]] = {"H100": TUNED_H100, "H200": TUNED_H200}

# FP8 weights (W8A16, kernels/fp8_linear.py) read half the bytes per tile row: their own tables,
# from the sweep with FP8 weights. There is no cuBLAS W8A16 to route to, so an entry is the sweep's
# best whatever cuBLAS bf16 does. Buckets a table lacks run the heuristic (512-byte rows, the
# tensor-core path), whose tiles leave an FP8 layer's linears more than twice as slow at one row.
# The LM head stays 16-bit (TUNED). Widening x and the weights to fp16 for the tensor cores pays
# only where two weight tiles share a step's x scaling (the fused gate/up at 32 rows), so only
# that entry takes it.
TUNED_FP8_H200: dict[ShapeKey, dict[int, SmallBatchConfig]] = {
    ShapeKey(6144, 4096): {1: _c(16, 512, 2, 4, 1, False), 8: _c(64, 128, 6, 4, 3, True),
                           16: _c(64, 128, 6, 4, 3, True), 32: _c(64, 128, 6, 4, 2, True)},  # qwen3-8b qkv
    ShapeKey(4096, 4096): {1: _c(32, 512, 4, 4, 1, False), 8: _c(64, 128, 9, 4, 3, True),
                           16: _c(64, 128, 9, 4, 3, True), 32: _c(64, 128, 5, 4, 3, True)},  # qwen3-8b o
    ShapeKey(24576, 4096): {1: _c(16, 512, 1, 4, 1, False), 8: _c(64, 128, 3, 4, 3, True),
                            16: _c(64, 128, 3, 4, 3, True), 32: _c(64, 128, 1, 4, 3, True)},  # qwen3-8b gate_up
    ShapeKey(24576, 4096, True): {1: _c(32, 256, 1, 8, 1, False), 8: _c(64, 128, 2, 4, 3, True),
                                  16: _c(64, 128, 2, 4, 3, True),
                                  32: _c(64, 128, 2, 4, 3, True, widen_f16=True)},  # gate_up+SwiGLU
    ShapeKey(4096, 12288): {1: _c(32, 256, 5, 4, 1, False), 8: _c(64, 128, 17, 4, 3, True),
                            16: _c(64, 128, 9, 4, 3, True), 32: _c(64, 128, 9, 4, 3, True)},  # qwen3-8b down
    ShapeKey(5120, 2048): {1: _c(32, 512, 4, 4, 1, False), 8: _c(64, 128, 8, 4, 2, True),
                           16: _c(64, 128, 8, 4, 2, True), 32: _c(64, 128, 7, 4, 2, True)},  # qwen3-30b-a3b qkv
    ShapeKey(2048, 4096): {1: _c(32, 256, 8, 4, 1, False), 8: _c(64, 256, 8, 4, 3, True),
                           16: _c(64, 256, 8, 4, 3, True), 32: _c(64, 256, 5, 4, 3, True)},  # qwen3-30b-a3b o
    ShapeKey(128, 2048): {1: _c(16, 512, 4, 8, 1, False), 8: _c(64, 128, 8, 4, 4, True),
                          16: _c(64, 128, 8, 4, 3, True), 32: _c(16, 512, 4, 4, 2, True)},  # qwen3-30b-a3b router
}

# The H100 (the same SMs and L2, less bandwidth) reads the H200's FP8 table: the 16-bit tables of
# the two GPUs agree on most shapes' one-row tiles, and the H100's own FP8 sweep at one row picked
# the same tilings.
TUNED_FP8: dict[str, dict[ShapeKey, dict[int, SmallBatchConfig]]] = {"H100": TUNED_FP8_H200, "H200": TUNED_FP8_H200}


def gpu_key(device_name: str) -> str:
    """The TUNED table a device name reads ("NVIDIA H100 80GB HBM3" -> "H100"); "" for none."""
    for key in ("H200", "H100"):
        if key in device_name:
            return key
    return ""


def tuned_config(m: int, n: int, k: int, gpu: str, gate_up: bool = False, fp8: bool = False) -> SmallBatchConfig | None:
    """The sweep's tiling for this GPU, shape and m's bucket (16-bit or FP8 weights), or None."""
    row = (TUNED_FP8 if fp8 else TUNED).get(gpu, {}).get(ShapeKey(n, k, gate_up))
    return row.get(m_bucket(m, fp8)) if row and 1 <= m <= (FP8_MAX_M if fp8 else MAX_M) else None


def heuristic_config(m: int, n: int, k: int, elem_bytes: int, num_sms: int, gate_up: bool = False) -> SmallBatchConfig:
    """512-byte row chunks (16-byte loads, 32 lanes along K), 32 rows a program (16 when
    that leaves SMs without a tile), and split-K until about four programs per SM are in
    flight (the dot path's 3 stages use ~48 KB of shared memory: four fit on an SM), within
    a workspace's default scratch."""
    block_k = 512 // elem_bytes
    outputs = n // 2 if gate_up else n
    block_n = 32 if -(-outputs // 32) >= num_sms else 16
    if m > 16:  # FP8 weights at 17..32 rows: the x tile [32, block_k] must leave room for the stages
        block_k, block_n = 128, 64
    tiles = -(-outputs // block_n)
    k_blocks = -(-k // block_k)
    scratch = PARTIAL_FLOATS // ((2 if gate_up else 1) * m * outputs)
    split_k = max(1, min(-(-4 * num_sms // tiles), k_blocks, 16, scratch))
    return SmallBatchConfig(block_n, block_k, split_k, num_warps=4, num_stages=3, use_dot=True)


def get_config(m: int, n: int, k: int, elem_bytes: int = 2, num_sms: int = 132,
               gate_up: bool = False, gpu: str = "") -> SmallBatchConfig:
    """The tuned config for this GPU, (n, k, gate_up) and m's bucket (16-bit weights: TUNED,
    FP8: TUNED_FP8), else the heuristic."""
    m_bucket(m, elem_bytes == 1)  # validates m
    tuned = tuned_config(m, n, k, gpu, gate_up, fp8=elem_bytes == 1) if elem_bytes in (1, 2) else None
    return tuned or heuristic_config(m, n, k, elem_bytes, num_sms, gate_up)
