"""Device check and timing of the decode-step launch cuts (needs CUDA).

1. Runs the kernel tests natively (pytest on the files in TEST_FILES, incl. the CUDA-graph
   engine test that drives the fused model path); skip with --no-tests.
2. Attention prologue of a Qwen3-8B-shaped layer (32 q / 8 kv heads, head_dim 128, page 16,
   bf16) at batch 1/8/32: unfused (q_norm, k_norm, rotary, store_kv: 4 launches, plus the
   copies rms_norm makes of strided q/k views) vs kernels.qk_norm_rope (1 launch).
3. Decode attention at ctx 1024 with splits=1: two-stage (stage 2 reduce launched) vs
   stage 1 writing the output directly; the auto split count for reference.
Timing: one CUDA graph replays the op for each of LAYERS layers (own KV per layer, as a
step does), do_bench median of the replay (L2 flushed once per replay), reported per layer.

    python3 -m loadtest.bench.fused_decode [--no-tests] [--json PATH]
    TRITON_INTERPRET=1 PYTHONPATH=. python -m loadtest.bench.fused_decode --smoke --no-tests   # CPU: checks the script
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

TEST_FILES = ["tests/kernels/test_kernels_qk_norm_rope.py", "tests/kernels/test_kernels_decode_attention.py",
              "tests/kernels/test_kernels_rotary_embedding.py", "tests/kernels/test_kernels_rms_norm.py",
              "tests/kernels/test_kernels_store_kv.py", "tests/kernels/test_triton_backend.py",
              "tests/kernels/test_cuda_graph.py"]


@dataclass(frozen=True)
class Shape:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    batches: tuple = (1, 8, 32)
    ctx: int = 1024
    layers: int = 36  # Qwen3-8B
    h_q: int = 32
    h_kv: int = 8
    head_dim: int = 128
    page_size: int = 16
    max_pos: int = 4096

    @classmethod
    def smoke(cls) -> "Shape":
        """Tiny, float32 (the interpreter's bf16 dot is wrong): exercises the script on CPU."""
        return cls(device="cpu", dtype=torch.float32, batches=(1, 3), ctx=40, layers=2, h_q=4, h_kv=2,
                   head_dim=32, page_size=4, max_pos=64)


@dataclass
class Row:
    op: str
    batch: int
    before_us: float  # per layer
    after_us: float
    rel_err: float  # after vs before (outputs and cache)
    note: str = ""


def per_layer_us(shape: Shape, fn) -> float:
    """fn runs the op once per layer. CUDA: graph-captured, do_bench median of the replay."""
    if shape.device != "cuda":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[1] * 1e6 / shape.layers
    import triton.testing

    from loadtest.bench.kernels import capture_graph
    graph = capture_graph(fn)
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return ms * 1e3 / shape.layers


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _cos_sin(shape: Shape) -> torch.Tensor:
    half = shape.head_dim // 2
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, half, dtype=torch.float64) / half)
    freqs = torch.outer(torch.arange(shape.max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), -1).to(shape.device, shape.dtype)


class Prologue:
    """One decode step's q/k/v (a qkv matmul output) and the per-layer caches."""

    def __init__(self, shape: Shape, batch: int, gen: torch.Generator):
        from kernels.qk_norm_rope import QKNorm

        s, dev = shape, shape.device
        self.shape = s
        self.qkv = torch.randn(batch, (s.h_q + 2 * s.h_kv) * s.head_dim, device=dev, generator=gen).to(s.dtype)
        self.positions = torch.randint(0, s.max_pos, (batch,), device=dev, generator=gen)
        self.cos_sin = _cos_sin(s)
        w = 1 + 0.1 * torch.randn(2, s.head_dim, device=dev, generator=gen)
        self.norm = QKNorm(w[0].to(s.dtype), w[1].to(s.dtype), 1e-6)
        pages = batch + 1
        self.pool = torch.zeros(pages, s.h_kv, s.layers, 2, s.page_size, s.head_dim, device=dev, dtype=s.dtype)
        self.slots = (torch.arange(batch, device=dev, dtype=torch.int32) + 1) * s.page_size + 1

    def views(self, qkv):
        s = self.shape
        q, k, v = qkv.split([s.h_q * s.head_dim, s.h_kv * s.head_dim, s.h_kv * s.head_dim], -1)
        return (q.view(-1, s.h_q, s.head_dim), k.view(-1, s.h_kv, s.head_dim), v.view(-1, s.h_kv, s.head_dim))

    def unfused(self, qkv, layers):
        """The model's fused=True path before qk_norm_rope: four launches per layer."""
        from kernels.rms_norm import rms_norm
        from kernels.rotary_embedding import rotary_embedding
        from kernels.store_kv import store_kv

        q, k, v = self.views(qkv)
        for layer in range(layers):
            qn, kn = rms_norm(q, self.norm.q_weight, self.norm.eps), rms_norm(k, self.norm.k_weight, self.norm.eps)
            rotary_embedding(self.positions, qn, kn, self.cos_sin)
            store_kv(self.pool[:, :, layer, 0], self.pool[:, :, layer, 1], kn, v, self.slots)
        return qn, kn

    def fused(self, qkv, layers):
        from kernels.qk_norm_rope import KVCacheWrite, qk_norm_rope

        q, k, v = self.views(qkv)
        for layer in range(layers):
            # in place: repeated calls keep re-norming the same buffer (values stay bounded)
            qk_norm_rope(self.positions, q, k, self.cos_sin, norm=self.norm,
                         kv_write=KVCacheWrite(self.pool[:, :, layer, 0], self.pool[:, :, layer, 1], v, self.slots))
        return q, k


def prologue_rows(shape: Shape, gen: torch.Generator) -> list:
    rows = []
    for batch in shape.batches:
        p = Prologue(shape, batch, gen)
        qn, kn = p.unfused(p.qkv, 1)
        cache_ref = p.pool[:, :, 0].clone()
        p.pool.zero_()
        qkv = p.qkv.clone()
        qf, kf = p.fused(qkv, 1)
        err = max(rel_err(qf, qn), rel_err(kf, kn), rel_err(p.pool[:, :, 0], cache_ref))
        before = per_layer_us(shape, lambda: p.unfused(p.qkv, shape.layers))
        after = per_layer_us(shape, lambda: p.fused(qkv, shape.layers))
        rows.append(Row("q/k norm + rope + store", batch, before, after, err, "4 launches -> 1"))
        del p
    return rows


def decode_rows(shape: Shape, gen: torch.Generator) -> list:
    from kernels.decode_attention import decode_attention_reference
    from kernels.triton_decode_attention import (DecodeConfig, _num_sms, choose_num_kv_splits,
                                                 launch_decode_attention)

    s = shape
    scale = 1 / math.sqrt(s.head_dim)
    two_stage, direct = DecodeConfig(direct_single_split=False), DecodeConfig()
    rows = []
    for batch in s.batches:
        pages_per_seq = math.ceil(s.ctx / s.page_size)
        pool = torch.randn(batch * pages_per_seq + 1, s.h_kv, s.layers, 2, s.page_size, s.head_dim,
                           device=s.device, generator=gen).to(s.dtype)
        ids = torch.randperm(batch * pages_per_seq, device=s.device, generator=gen) + 1
        page_table = ids.view(batch, pages_per_seq).to(torch.int32)
        seq_lens = torch.full((batch,), s.ctx, dtype=torch.int32, device=s.device)
        q = torch.randn(batch, s.h_q, s.head_dim, device=s.device, generator=gen).to(s.dtype)
        out = torch.empty_like(q)

        def run(splits, cfg):
            for layer in range(s.layers):
                launch_decode_attention(q, pool[:, :, layer, 0], pool[:, :, layer, 1], page_table, seq_lens, scale,
                                        splits, out, cfg)
            return out

        ref = decode_attention_reference(q, pool[:, :, 0, 0], pool[:, :, 0, 1], page_table, seq_lens, scale)
        launch_decode_attention(q, pool[:, :, 0, 0], pool[:, :, 0, 1], page_table, seq_lens, scale, 1, out, direct)
        err = rel_err(out, ref)
        before = per_layer_us(s, lambda: run(1, two_stage))
        after = per_layer_us(s, lambda: run(1, direct))
        auto = choose_num_kv_splits(batch, s.h_kv, page_table.shape[1] * s.page_size, _num_sms(q.device))
        auto_us = per_layer_us(s, lambda: run(None, direct))
        rows.append(Row(f"decode attn ctx {s.ctx}, splits=1", batch, before, after, err,
                        f"2 launches -> 1; auto splits={auto}: {auto_us:.2f} us"))
        del pool
    return rows


def run_tests() -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", *TEST_FILES]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print("\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:]), flush=True)
    return proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tests", action="store_true", help="skip the native pytest run")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; CPU with TRITON_INTERPRET=1")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_fused_decode.json"))
    args = parser.parse_args()
    shape = Shape.smoke() if args.smoke else Shape()
    if shape.device == "cuda" and not torch.cuda.is_available():
        print("bench_fused_decode needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    t0 = time.time()
    tests_rc = 0 if args.no_tests else run_tests()
    gen = torch.Generator(device=shape.device).manual_seed(0)
    name = torch.cuda.get_device_properties(0).name if shape.device == "cuda" else "cpu (interpreter)"
    rows = prologue_rows(shape, gen) + decode_rows(shape, gen)
    print(f"device {name}; per-layer us, {shape.layers} layers per graph replay")
    print(f"{'op':34s} {'B':>3s} {'before':>8s} {'after':>8s} {'saved':>7s} {'relerr':>8s}  note")
    for r in rows:
        print(f"{r.op:34s} {r.batch:3d} {r.before_us:8.2f} {r.after_us:8.2f} {r.before_us - r.after_us:7.2f} "
              f"{r.rel_err:8.1e}  {r.note}")
    print(f"tests rc={tests_rc}; {time.time() - t0:.0f} s")
    with open(args.json, "w") as f:
        json.dump({"device": name, "tests_rc": tests_rc, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return tests_rc


if __name__ == "__main__":
    sys.exit(main())
