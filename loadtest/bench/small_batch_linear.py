"""Device benchmark of kernels.small_batch_linear against cuBLAS (torch F.linear) at decode
batch sizes (needs CUDA).

For the linears of Qwen3-8B (TP 1 and 2), Qwen3-0.6B and Qwen3-30B-A3B's attention, M in
{1, 2, 4, 8, 16}: both sides captured in CUDA graphs that run the op over enough distinct
weight copies (>= 4x the L2 size in all) that every weight is read from HBM, as in a
decode step. Prints us per op, GB/s, the fraction of the device copy bandwidth measured in
the same run, and the speed-up over cuBLAS; the fused gate/up + SwiGLU against cuBLAS +
kernels.silu_and_mul (the engine's path today); a whole-layer line per model (sum of the
layer's linears at M=1, times the layers, plus the LM head) with the predicted per-step
saving. --sweep tries a modest grid of tilings per (shape, M) by coordinate descent and
prints the best, ready to paste into kernels/small_batch_linear_config.py.
--fp8: the same with block-FP8 weights (128x128 scales, W8A16: kernels/fp8_linear.py), against
cuBLAS on the bf16 weights (what the model runs without FP8); GB/s and the floor count FP8 bytes,
and the sweep's lines go to TUNED_FP8 whether or not they beat bf16 cuBLAS (an FP8 linear of
<= 32 rows always runs this kernel). --fp8-before also times each tensor-core row with the other
widening (SmallBatchConfig.widen_f16); --fp8-dot-only sweeps the tensor-core path only.

    python3 -m loadtest.bench.small_batch_linear [--sweep] [--fp8] [--models qwen3-8b,...] [--json PATH]
    TRITON_INTERPRET=1 PYTHONPATH=. python -m loadtest.bench.small_batch_linear --smoke --sweep   # CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

M_VALUES = (1, 2, 4, 8, 16)
WIN_MARGIN = 0.98  # a tiling goes into the table only if at least 2% faster than cuBLAS


@dataclass(frozen=True)
class Linear:
    name: str
    n: int  # weight rows (gate/up: 2I, the stacked weight)
    k: int
    gate_up: bool = False  # also time the fused gate/up + SwiGLU
    per_layer: bool = True  # False: once per step (LM head)


@dataclass(frozen=True)
class ModelShapes:
    name: str
    layers: int
    linears: tuple


def _qwen3(name, layers, hidden, heads, kv_heads, inter, vocab=151936, tp=1, head_dim=128, router=0):
    q, kv = heads * head_dim // tp, kv_heads * head_dim // tp
    lins = [Linear("qkv", q + 2 * kv, hidden), Linear("o", hidden, q)]
    if inter:
        lins += [Linear("gate_up", 2 * inter // tp, hidden, gate_up=True), Linear("down", hidden, inter // tp)]
    if router:
        lins.append(Linear("router", router, hidden))
    lins.append(Linear("lm_head", -(-vocab // tp), hidden, per_layer=False))
    return ModelShapes(name, layers, tuple(lins))


MODELS = {
    m.name: m for m in (
        _qwen3("qwen3-8b", 36, 4096, 32, 8, 12288),
        _qwen3("qwen3-8b-tp2", 36, 4096, 32, 8, 12288, tp=2),
        _qwen3("qwen3-0.6b", 28, 1024, 16, 8, 3072),
        # attention + router + LM head only: the experts run in the fused-MoE kernel
        _qwen3("qwen3-30b-a3b", 48, 2048, 32, 4, 0, router=128),
    )
}
SMOKE_MODELS = {"smoke": ModelShapes("smoke", 2, (Linear("qkv", 96, 64), Linear("gate_up", 64, 48, gate_up=True),
                                                  Linear("down", 40, 80), Linear("lm_head", 200, 64, per_layer=False)))}


@dataclass
class Setup:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    m_values: tuple = M_VALUES
    l2_bytes: int = 50 << 20
    min_bytes_per_graph: int = 0  # filled from l2_bytes: weights read per replay
    replays: int = 10
    smoke: bool = False
    fp8: bool = False  # block-FP8 weights (x and the output stay in dtype)
    fp8_before: bool = False  # FP8: also time each tensor-core tiling with the other widening (fp16 / x's dtype)
    fp8_dot_only: bool = False  # FP8 sweep: the tensor-core path only (M=1 skips the CUDA-core descent)

    @classmethod
    def for_device(cls) -> "Setup":
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        return cls(l2_bytes=l2, min_bytes_per_graph=4 * l2)

    @classmethod
    def smoke_setup(cls) -> "Setup":
        return cls(device="cpu", dtype=torch.float32, m_values=(1, 3), min_bytes_per_graph=1, replays=1, smoke=True)


@dataclass
class Row:
    model: str
    linear: str
    n: int
    k: int
    m: int
    op: str  # "linear" or "gate_up+silu"
    ours_us: float
    cublas_us: float
    weight_bytes: int
    rel_err: float
    config: str
    before_us: float = float("nan")  # FP8 with --fp8-before: the same tiling with the other widening

    def gb_s(self, us: float) -> float:
        return self.weight_bytes / us / 1e3

    @property
    def speedup(self) -> float:
        return self.cublas_us / self.ours_us


# ---------------------------------------------------------------- timing

def _capture(fns):
    """One CUDA graph running fns in order, after a warm-up on a side stream."""
    for fn in fns[:1]:
        fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def us_per_op(setup: Setup, fns) -> float:
    """Median microseconds per call of a graph that runs each of fns (one per weight copy) once."""
    if setup.device != "cuda":
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t0) * 1e6 / len(fns)
    return graph_replay_ms(fns, setup.replays) * 1e3 / len(fns)


def graph_replay_ms(fns, replays: int) -> float:
    """Median milliseconds of one replay of a CUDA graph running fns in order (no launch
    overhead: as a decode step runs)."""
    graph = _capture(fns)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def copy_bandwidth(setup: Setup) -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting read + write (as kernels/NOTES.md)."""
    if setup.device != "cuda":
        return float("nan")
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = us_per_op(setup, [lambda: dst.copy_(src)] * 4)
    del src, dst
    return 2 * (1 << 29) * 2 / (us * 1e-6)


FP8_BLOCK = (128, 128)  # the official FP8 releases' weight blocks


class WeightCopies:
    """Distinct copies of one random weight, enough of them that a graph over all reads
    >= setup.min_bytes_per_graph (so the weights come from HBM, not L2). fp8: block-FP8
    copies (kernels.fp8.Fp8Weight), each its own quantization."""

    def __init__(self, setup: Setup, n: int, k: int, gen: torch.Generator, fp8: bool = False):
        nbytes = n * k * (1 if fp8 else setup.dtype.itemsize)
        self.count = max(2, math.ceil(setup.min_bytes_per_graph / nbytes)) if not setup.smoke else 2
        first = torch.randn(n, k, device=setup.device, generator=gen) * 0.02
        convert = _fp8_weight if fp8 else (lambda w: w.to(setup.dtype))
        # one float32 copy at a time: the LM head's is 2.5 GB
        self.weights = [convert(first if i == 0 else first.roll(i, 0)) for i in range(self.count)]
        self.nbytes = nbytes


def _fp8_weight(w: torch.Tensor):
    from kernels.fp8 import Fp8Weight, block_scale_rows, quantize_block

    q, scale = quantize_block(w, FP8_BLOCK)
    # tile_n as the engine's loader sets it (quantization/fp8_params.py): the scale row changes
    # every block of rows, and the bench's shapes are whole blocks
    tile_n = FP8_BLOCK[0] if w.shape[0] % FP8_BLOCK[0] == 0 else 0
    return Fp8Weight(q, scale, block_scale_rows(w.shape[0], FP8_BLOCK[0]).to(w.device), FP8_BLOCK[1], tile_n)


# ---------------------------------------------------------------- measuring

def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class ShapeBench:
    """One linear's weights and inputs; times ours and cuBLAS at a given M."""

    def __init__(self, setup: Setup, lin: Linear, gen: torch.Generator):
        from kernels.small_batch_linear import SmallBatchWorkspace

        self.setup, self.lin, self.gen = setup, lin, gen
        self.copies = WeightCopies(setup, lin.n, lin.k, gen, fp8=setup.fp8)
        self._dense = None if setup.fp8 else self.copies  # cuBLAS's bf16 weights (made when first timed)
        self.x_all = torch.randn(max(setup.m_values), lin.k, device=setup.device, generator=gen).to(setup.dtype)
        self.workspace = SmallBatchWorkspace.create(setup.device, max_partial_floats=1 << 22, max_tiles=1 << 15)

    def x(self, m):
        return self.x_all[:m]

    def _op(self, gate_up: bool):
        """(x, w, out, config, workspace) -> out: the kernel these weights run."""
        if self.setup.fp8:
            from kernels.fp8_linear import small_batch_fp8_linear

            return lambda x, w, **kw: small_batch_fp8_linear(x, w, gate_up=gate_up, **kw)
        from kernels.small_batch_linear import small_batch_gate_up_silu, small_batch_linear

        return small_batch_gate_up_silu if gate_up else small_batch_linear

    def ours(self, m: int, config=None, gate_up: bool = False, **kw) -> float:
        x = self.x(m)
        n_out = self.lin.n // 2 if gate_up else self.lin.n
        out = torch.empty(m, n_out, device=self.setup.device, dtype=self.setup.dtype)
        op = self._op(gate_up)
        fns = [lambda w=w: op(x, w, out=out, config=config, workspace=self.workspace, **kw)
               for w in self.copies.weights]
        return us_per_op(self.setup, fns)

    def cublas(self, m: int, gate_up: bool = False) -> float:
        """cuBLAS on 16-bit weights (FP8 runs: the same shape in bf16, what runs without FP8)."""
        from kernels.silu_and_mul import silu_and_mul

        if self._dense is None:
            self._dense = WeightCopies(self.setup, self.lin.n, self.lin.k, self.gen)
        x = self.x(m)
        if gate_up:
            fns = [lambda w=w: silu_and_mul(F.linear(x, w)) for w in self._dense.weights]
        else:
            fns = [lambda w=w: F.linear(x, w) for w in self._dense.weights]
        return us_per_op(self.setup, fns)

    def error(self, m: int, config=None, gate_up: bool = False) -> float:
        x, w = self.x(m), self.copies.weights[0]
        got = self._op(gate_up)(x, w, config=config, workspace=self.workspace)
        if self.setup.fp8:
            from kernels.fp8_linear import gate_up_silu_fp8_reference, small_batch_fp8_reference

            return rel_err(got, gate_up_silu_fp8_reference(x, w) if gate_up else small_batch_fp8_reference(x, w))
        from kernels.small_batch_linear import small_batch_gate_up_silu_reference, small_batch_linear_reference

        return rel_err(got, small_batch_gate_up_silu_reference(x, w) if gate_up else small_batch_linear_reference(x, w))


def _config_of(setup: Setup, lin: Linear, m: int, gate_up: bool):
    """What the engine picks: this GPU's table (16-bit or FP8), else the heuristic."""
    from kernels.small_batch_linear_config import get_config, gpu_key

    cuda = setup.device == "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 8
    elem = 1 if setup.fp8 else setup.dtype.itemsize
    return get_config(m, lin.n, lin.k, elem, sms, gate_up, gpu_key(torch.cuda.get_device_name(0)) if cuda else "")


def measure_model(setup: Setup, model: ModelShapes, gen: torch.Generator, say) -> list:
    rows = []
    for lin in model.linears:
        sb = ShapeBench(setup, lin, gen)
        ops = [False, True] if lin.gate_up else [False]
        for m in setup.m_values:
            for gate_up in ops:
                cfg = _config_of(setup, lin, m, gate_up)
                try:
                    ours_us, err = sb.ours(m, cfg, gate_up), sb.error(m, cfg, gate_up)
                except Exception as exc:  # report and go on: one bad tiling must not end the run
                    say(f"  {model.name} {lin.name} M={m} {_short(cfg)} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    ours_us, err = float("nan"), float("nan")
                flip = setup.fp8 and setup.fp8_before and cfg.use_dot
                before = sb.ours(m, replace(cfg, widen_f16=not cfg.widen_f16), gate_up) if flip else float("nan")
                row = Row(model.name, lin.name, lin.n, lin.k, m, "gate_up+silu" if gate_up else "linear",
                          ours_us, sb.cublas(m, gate_up), sb.copies.nbytes, err, _short(cfg), before)
                rows.append(row)
                say(f"  {row.model:14s} {row.linear:8s} {row.op:12s} {lin.n:6d}x{lin.k:<5d} M={m:<2d} "
                    f"ours {row.ours_us:8.2f} us  cuBLAS {row.cublas_us:8.2f} us  x{row.speedup:4.2f}  "
                    f"relerr {row.rel_err:.1e}  {row.config}"
                    + (f"  (widening to {'bf16' if cfg.widen_f16 else 'fp16'} instead: {before:.2f} us)"
                       if before == before else ""))
        del sb
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _short(cfg) -> str:
    return (f"bn{cfg.block_n} bk{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages} "
            f"{'dot' if cfg.use_dot else 'fma'}{' f16' if cfg.widen_f16 else ''}")


# ---------------------------------------------------------------- sweep

def _split_for(setup: Setup, lin: Linear, cfg, gate_up: bool, waves: int) -> int:
    """The split count that puts about `waves` programs on every SM (each split >= 2 K blocks)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if setup.device == "cuda" else 8
    tiles = -(-(lin.n // 2 if gate_up else lin.n) // cfg.block_n)
    k_blocks = -(-lin.k // cfg.block_k)
    return max(1, min(-(-waves * sms // tiles), k_blocks // 2, 32))


TILES = ((16, 256), (16, 512), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128))
# FP8 rows are half the bytes: the same byte widths and one wider (a tile spans scale groups)
TILES_FP8 = ((16, 512), (16, 1024), (32, 256), (32, 512), (64, 256), (64, 128), (128, 128))


def sweep_shape(setup: Setup, sb: ShapeBench, m: int, gate_up: bool, limit: int = 0) -> tuple:
    """Coordinate descent from the current config: tiles (each with the split count that puts
    ~4 programs on an SM), then warps x stages, then split counts. At M=1 a second descent
    starts from the CUDA-core path. Returns (best config, best us, configs tried)."""
    tried: dict = {}

    def t(cfg):
        if cfg not in tried:
            try:
                tried[cfg] = sb.ours(m, cfg, gate_up)
            except Exception as exc:  # e.g. out of shared memory or registers for a tiling
                print(f"    {_short(cfg)} failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                tried[cfg] = float("inf")
        return tried[cfg]

    def descend(best):
        t(best)
        # the CUDA-core loop is not software-pipelined: stages do not matter there
        warps_stages = ((4, 2), (4, 3), (4, 4), (8, 3)) if best.use_dot else ((4, 1), (8, 1))
        steps = [
            lambda b: [replace(b, block_n=bn, block_k=bk, split_k=_split_for(setup, sb.lin, replace(b, block_n=bn,
                       block_k=bk), gate_up, 4)) for bn, bk in (TILES_FP8 if setup.fp8 else TILES)],
            lambda b: [replace(b, num_warps=w, num_stages=st) for w, st in warps_stages],
            lambda b: [replace(b, split_k=s) for s in
                       sorted({1} | {_split_for(setup, sb.lin, b, gate_up, waves) for waves in (1, 2, 4, 8)})],
        ]
        if setup.fp8 and best.use_dot:
            steps.append(lambda b: [replace(b, widen_f16=not b.widen_f16)])
        for step in steps:
            cands = step(best)
            for c in cands[:limit or None]:
                if t(c) < tried[best]:
                    best = c
        return best

    start = _config_of(setup, sb.lin, m, gate_up)
    if setup.fp8 and not start.use_dot:  # an FMA start's K tile is too wide for the dot's stages
        start = replace(start, block_n=64, block_k=128, num_stages=3)
    bests = [descend(replace(start, use_dot=True))]
    # FP8 at M=1: the CUDA-core path widens each weight to fp32 (a quarter-rate conversion) and
    # lost to the fp16 tensor-core path; 16-bit weights still try both
    if m == 1 and not (setup.fp8 and setup.fp8_dot_only):
        bests.append(descend(replace(start, use_dot=False, num_stages=1)))
    best = min(bests, key=lambda c: tried[c])
    return best, tried[best], len(tried)


def sweep(setup: Setup, models, gen: torch.Generator, say, limit: int = 0) -> list:
    lines = []
    for model in models:
        for lin in model.linears:
            if setup.fp8 and not lin.per_layer:
                continue  # the LM head stays 16-bit in an FP8 model
            sb = ShapeBench(setup, lin, gen)
            # FP8 gate/up runs fused with SwiGLU at decode sizes (fp8_gate_up_silu): only that op is swept
            for gate_up in ([True] if lin.gate_up and setup.fp8 else [False, True] if lin.gate_up else [False]):
                entries = []
                for m in setup.m_values:
                    best, us, count = sweep_shape(setup, sb, m, gate_up, limit)
                    err = sb.error(m, best, gate_up)
                    gbs = sb.copies.nbytes / us / 1e3
                    cublas = sb.cublas(m, gate_up)
                    # a 16-bit entry also routes the engine's linear here ("auto"): only where it
                    # wins; FP8 linears always run here, so their best always goes in
                    wins = setup.fp8 or us < WIN_MARGIN * cublas
                    say(f"  sweep {model.name} {lin.name}{' fused' if gate_up else ''} {lin.n}x{lin.k} M={m}: "
                        f"{us:.2f} us {gbs:.0f} GB/s vs cuBLAS {cublas:.2f} us{'' if wins else ' (no win: left out)'} "
                        f"({count} tried, relerr {err:.1e}) {_short(best)}")
                    if wins:
                        entries.append(f"{m}: _c({best.block_n}, {best.block_k}, {best.split_k}, {best.num_warps}, "
                                       f"{best.num_stages}, {best.use_dot}{', widen_f16=True' if best.widen_f16 else ''})")
                if entries:
                    lines.append(f"    ShapeKey({lin.n}, {lin.k}{', True' if gate_up else ''}): "
                                 f"{{{', '.join(entries)}}},  # {model.name} {lin.name}")
            del sb
            if setup.device == "cuda":
                torch.cuda.empty_cache()
    return lines


# ---------------------------------------------------------------- report

def layer_lines(rows: list, models, copy_bps: float) -> list:
    """Per model at M=1: the layer's linears (fused gate/up where it exists) ours vs cuBLAS."""
    out = []
    for model in models:
        def pick(lin, op):
            return next((r for r in rows if r.model == model.name and r.linear == lin.name and r.m == 1
                         and r.op == op), None)

        layer_ours = layer_cublas = layer_bytes = 0.0
        head = None
        for lin in model.linears:
            plain = pick(lin, "linear")
            if plain is None:
                continue
            if not lin.per_layer:
                head = plain
                continue
            fused = pick(lin, "gate_up+silu") if lin.gate_up else None
            ours = min(plain.ours_us, fused.ours_us) if fused else plain.ours_us
            cublas = fused.cublas_us if fused else plain.cublas_us  # cuBLAS + silu_and_mul, as the engine
            layer_ours, layer_cublas = layer_ours + ours, layer_cublas + cublas
            layer_bytes += plain.weight_bytes
        if not layer_bytes:
            continue
        floor_us = layer_bytes / copy_bps * 1e6 if copy_bps == copy_bps else float("nan")
        step_saving_ms = model.layers * (layer_cublas - layer_ours) / 1e3
        if head:
            step_saving_ms += (head.cublas_us - head.ours_us) / 1e3
        out.append(f"{model.name}: layer linears at M=1 ours {layer_ours:.1f} us vs cuBLAS {layer_cublas:.1f} us "
                   f"(bytes floor {floor_us:.1f} us; ours {layer_ours / floor_us:.2f}x, cuBLAS "
                   f"{layer_cublas / floor_us:.2f}x); x{model.layers} layers"
                   + (f" + LM head ({head.ours_us:.1f} vs {head.cublas_us:.1f} us)" if head else "")
                   + f": predicted step saving {step_saving_ms:.3f} ms")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ",".join(MODELS))
    parser.add_argument("--m", default=",".join(map(str, M_VALUES)), help="batch rows to time")
    parser.add_argument("--sweep", action="store_true", help="also search tilings per (shape, M)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; CPU with TRITON_INTERPRET=1")
    parser.add_argument("--fp8", action="store_true", help="block-FP8 weights (W8A16); the sweep fills TUNED_FP8")
    parser.add_argument("--fp8-before", action="store_true",
                        help="FP8: also time each tensor-core row with the other widening (fp16 or x's dtype)")
    parser.add_argument("--fp8-dot-only", action="store_true",
                        help="FP8 sweep: the tensor-core path only (no CUDA-core descent at M=1)")
    out_dir = os.environ.get("OUT")
    parser.add_argument("--json", default=os.path.join(out_dir, "bench_small_batch_linear.json") if out_dir else None,
                        help="default: $OUT/bench_small_batch_linear.json when OUT is set, else none")
    args = parser.parse_args()
    if args.smoke:
        from kernels.availability import triton_interpret_enabled

        if not torch.cuda.is_available() and not triton_interpret_enabled():
            print("--smoke without CUDA needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        setup, models = Setup.smoke_setup(), list(SMOKE_MODELS.values())
    else:
        if not torch.cuda.is_available():
            print("small_batch_linear bench needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        setup = replace(Setup.for_device(), m_values=tuple(int(v) for v in args.m.split(",")))
        models = [MODELS[name] for name in args.models.split(",")]
    setup = replace(setup, fp8=args.fp8, fp8_before=args.fp8_before, fp8_dot_only=args.fp8_dot_only)
    t0 = time.time()
    lines: list = []

    def say(line):
        print(line, flush=True)
        lines.append(line)

    import triton

    device_name = torch.cuda.get_device_properties(0).name if setup.device == "cuda" else "cpu (interpreter)"
    say(f"device {device_name}; torch {torch.__version__}, triton {triton.__version__}; {setup.dtype}"
        + (" activations, block-FP8 weights (cuBLAS: the same shapes in that dtype)" if setup.fp8 else ""))
    copy_bps = copy_bandwidth(setup)
    say(f"copy bandwidth {copy_bps / 1e12:.2f} TB/s (read + write); weights >= {setup.min_bytes_per_graph >> 20} "
        "MiB per graph replay (L2 cold)")
    gen = torch.Generator(device=setup.device).manual_seed(0)
    rows = []
    for model in models:
        rows += measure_model(setup, model, gen, say)
    say(f"measured in {time.time() - t0:.0f} s")
    sweep_lines = []
    if args.sweep:
        sweep_lines = sweep(setup, models, gen, say, limit=1 if setup.smoke else 0)
        from kernels.small_batch_linear_config import gpu_key
        gpu = gpu_key(torch.cuda.get_device_name(0)) if setup.device == "cuda" else ""
        table = "TUNED_FP8" if setup.fp8 else "TUNED"
        rule = "the best tiling per shape" if setup.fp8 else f"faster than cuBLAS by >= {100 * (1 - WIN_MARGIN):.0f}%"
        say(f"tuned table entries, {rule} (paste into {table}['{gpu or 'this GPU'}'] in "
            "kernels/small_batch_linear_config.py):")
        for line in sweep_lines:
            say(line)
    summary = layer_lines(rows, models, copy_bps)
    say("")
    say(f"{'model':14s} {'linear':8s} {'op':12s} {'N x K':>12s} {'M':>2s} {'ours us':>8s} {'GB/s':>6s} {'%copy':>5s} "
        f"{'cuBLAS us':>9s} {'GB/s':>6s} {'%copy':>5s} {'speedup':>7s}")
    for r in rows:
        pct = (lambda us: 100 * r.gb_s(us) * 1e9 / copy_bps) if copy_bps == copy_bps else (lambda us: float("nan"))
        say(f"{r.model:14s} {r.linear:8s} {r.op:12s} {f'{r.n}x{r.k}':>12s} {r.m:2d} {r.ours_us:8.2f} "
            f"{r.gb_s(r.ours_us):6.0f} {pct(r.ours_us):5.1f} {r.cublas_us:9.2f} {r.gb_s(r.cublas_us):6.0f} "
            f"{pct(r.cublas_us):5.1f} {r.speedup:7.2f}")
    for line in summary:
        say(line)
    say(f"total {time.time() - t0:.0f} s")
    if not args.json:
        return 0
    with open(args.json, "w") as f:
        json.dump({"device": device_name, "copy_bytes_per_s": copy_bps, "rows": [asdict(r) for r in rows],
                   "layers": summary, "sweep_table": sweep_lines, "log": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
