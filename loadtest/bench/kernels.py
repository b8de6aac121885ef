"""Device micro-benchmark of the Triton kernels in `kernels/` (needs CUDA).

Times decode attention (B = 1, 8, 32, 128 at context 1024) and extend
attention (1/4/16 prompts x 2048 new tokens, plus one cached-prefix case) for
Qwen3-8B-like heads (32 q heads, 8 kv heads, head_dim 128, page 16, bf16) with
triton.testing.do_bench (median; it flushes L2 before every timed call), and
prints achieved GB/s and TFLOP/s against the device's own ceilings measured
here: a large device-to-device copy (bytes read + written) and an 8192^3 bf16
matmul. Floor = max(bytes / copy bandwidth, flops / matmul rate).

    PYTHONPATH=. python -m loadtest.bench.kernels [--json PATH]
    TRITON_INTERPRET=1 PYTHONPATH=. python -m loadtest.bench.kernels --smoke   # CPU: tiny shapes, checks the script
"""

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import time

import torch

H_Q, H_KV, HEAD_DIM, PAGE_SIZE, NUM_LAYERS = 32, 8, 128, 16, 4
ELEM = 2  # bytes per element (bf16, or fp16 in --smoke)


@dataclass
class Row:
    name: str
    ms: float  # GPU time; decode: CUDA-graph replay with L2 flushed (what the engine runs)
    eager_ms: float  # decode only: a plain call, host launch overhead included (nan elsewhere)
    gbytes: float
    gflop: float
    floor_ms: float
    sdpa_ms: float  # torch SDPA over dense, unpaged K/V of the same problem
    rel_err: float
    note: str = ""

    @property
    def gb_s(self) -> float:
        return self.gbytes / self.ms * 1e3

    @property
    def tflop_s(self) -> float:
        return self.gflop / self.ms

    @property
    def floor_ratio(self) -> float:
        return self.ms / self.floor_ms


@dataclass
class BenchConfig:
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    decode_batches: tuple = (1, 8, 32, 128)
    decode_ctx: int = 1024
    extend_cases: tuple = ((1, 2048, 0), (4, 2048, 0), (16, 2048, 0), (4, 512, 1536))  # (prompts, new, prefix)
    small_tokens: int = 4096
    small_hidden: int = 4096
    small_inter: int = 12288
    gather_pool_pages: int = 2048
    gather_layers: int = 36
    gather_n: int = 128
    big_copy_elems: int = 2**29
    matmul_n: int = 8192
    sweep_decode_ragged: tuple = (1000, 1, 17, 300, 0)  # seq lens for the sweep's correctness check
    sweep_extend_ragged: tuple = ((300, 1, 129, 64), (0, 700, 33, 1024))  # (new, prefix) lens
    sweep_limit: int = 0  # try only the first N configs (0: all)

    @classmethod
    def smoke(cls) -> "BenchConfig":
        """Tiny shapes that run through the interpreter on CPU: exercises the script only."""
        # fp16: the interpreter's tl.dot is wrong for bf16 (numpy has no bf16)
        return cls(device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.float16, decode_batches=(1, 2),
                   decode_ctx=40, extend_cases=((1, 24, 0), (2, 16, 20)), small_tokens=4, small_hidden=64,
                   small_inter=64, gather_pool_pages=6, gather_layers=2, gather_n=3, big_copy_elems=2**16,
                   matmul_n=128, sweep_decode_ragged=(40, 1, 0), sweep_extend_ragged=((20, 1), (0, 30)),
                   sweep_limit=1)


def bench(cfg: BenchConfig, fn) -> float:
    """Median milliseconds."""
    if cfg.device != "cuda":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1]
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def bench_replay(cfg: BenchConfig, fn) -> float:
    """Median ms of fn captured in a CUDA graph, L2 flushed before each replay
    (do_bench does that): GPU time without host launch overhead."""
    if cfg.device != "cuda":
        return bench(cfg, fn)
    return bench(cfg, capture_graph(fn).replay)


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """fn captured once in a CUDA graph, after a compile call and a warm-up on a side stream."""
    fn()  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def copy_bandwidth(cfg: BenchConfig) -> float:
    """Bytes/s for a 2 GiB device-to-device copy, counting read + write."""
    src = torch.randn(cfg.big_copy_elems, device=cfg.device)  # 2 GiB of float32
    dst = torch.empty_like(src)
    ms = bench(cfg, lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)


def matmul_rate(cfg: BenchConfig) -> float:
    """bf16 FLOP/s of an 8192^3 matmul on random data."""
    n = cfg.matmul_n
    a = torch.randn(n, n, device=cfg.device, dtype=cfg.dtype)
    b = torch.randn(n, n, device=cfg.device, dtype=cfg.dtype)
    ms = bench(cfg, lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3)


def paged_pool(cfg: BenchConfig, num_seqs: int, seq_len: int, gen: torch.Generator):
    """Pool [pages, H_kv, layers, 2, page, D] (the engine's order) with each sequence's pages at
    random ids; returns (pool, page_table, seq_lens) for layer 1."""
    pages_per_seq = math.ceil(seq_len / PAGE_SIZE)
    num_pages = num_seqs * pages_per_seq + 1
    pool = torch.randn((num_pages, H_KV, NUM_LAYERS, 2, PAGE_SIZE, HEAD_DIM), device=cfg.device, dtype=cfg.dtype,
                       generator=gen)
    ids = torch.randperm(num_pages - 1, device=cfg.device, generator=gen) + 1
    page_table = ids.view(num_seqs, pages_per_seq).to(torch.int32)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=cfg.device)
    return pool, page_table, seq_lens


def dense_kv(cache, page_table, seq_len):
    """[B, H_kv, L, D] contiguous copy of the paged cache (for the SDPA baseline)."""
    pos = torch.arange(seq_len, device=cache.device)
    pages = page_table.long()[:, pos // PAGE_SIZE]  # [B, L]
    return cache[pages, :, (pos % PAGE_SIZE)[None, :].expand_as(pages)].permute(0, 2, 1, 3).contiguous()


def decode_rows(cfg: BenchConfig, ceil_bw: float, ceil_flops: float, gen: torch.Generator):
    from kernels.decode_attention import decode_attention, decode_attention_reference
    from kernels.triton_decode_attention import _num_sms, choose_num_kv_splits

    ctx = cfg.decode_ctx
    scale = 1 / math.sqrt(HEAD_DIM)
    rows = []
    for batch in cfg.decode_batches:
        pool, page_table, seq_lens = paged_pool(cfg, batch, ctx, gen)
        k_cache, v_cache = pool[:, :, 1, 0], pool[:, :, 1, 1]
        q = torch.randn((batch, H_Q, HEAD_DIM), device=cfg.device, dtype=cfg.dtype, generator=gen)
        out = torch.empty_like(q)
        args = (q, k_cache, v_cache, page_table, seq_lens, scale)
        decode_attention(*args, out=out)
        err = rel_err(out, decode_attention_reference(*args))
        ms = bench_replay(cfg, lambda: decode_attention(*args, out=out))
        eager_ms = bench(cfg, lambda: decode_attention(*args, out=out))
        k_dense, v_dense = dense_kv(k_cache, page_table, ctx), dense_kv(v_cache, page_table, ctx)
        q4 = q[:, :, None, :]
        sdpa_ms = bench(cfg, lambda: torch.nn.functional.scaled_dot_product_attention(
            q4, k_dense, v_dense, scale=scale, enable_gqa=True))
        nbytes = batch * ctx * H_KV * HEAD_DIM * 2 * ELEM + 2 * batch * H_Q * HEAD_DIM * ELEM
        flops = 4 * batch * H_Q * ctx * HEAD_DIM
        floor_ms = max(nbytes / ceil_bw, flops / ceil_flops) * 1e3
        splits = choose_num_kv_splits(batch, H_KV, page_table.shape[1] * PAGE_SIZE, _num_sms(q.device))
        rows.append(Row(f"decode B={batch} ctx={ctx}", ms, eager_ms, nbytes / 1e9, flops / 1e9, floor_ms,
                        sdpa_ms, err, f"splits={splits}"))
        del pool, k_dense, v_dense
    return rows


def extend_rows(cfg: BenchConfig, ceil_bw: float, ceil_flops: float, gen: torch.Generator):
    from kernels.extend_attention import extend_attention, extend_attention_reference

    scale = 1 / math.sqrt(HEAD_DIM)
    rows = []
    for num_prompts, new_tokens, prefix in cfg.extend_cases:
        total = prefix + new_tokens
        pool, page_table, seq_lens = paged_pool(cfg, num_prompts, total, gen)
        k_cache, v_cache = pool[:, :, 1, 0], pool[:, :, 1, 1]
        q = torch.randn((num_prompts * new_tokens, H_Q, HEAD_DIM), device=cfg.device, dtype=cfg.dtype, generator=gen)
        qo_indptr = torch.arange(0, num_prompts + 1, device=cfg.device, dtype=torch.int32) * new_tokens
        out = torch.empty_like(q)
        args = (q, k_cache, v_cache, page_table, qo_indptr, seq_lens, scale)
        extend_attention(*args, max_extend_len=new_tokens, out=out)
        err = rel_err(out, extend_attention_reference(*args)) if num_prompts <= 4 else float("nan")
        ms = bench(cfg, lambda: extend_attention(*args, max_extend_len=new_tokens, out=out))
        # SDPA baseline: dense K/V, causal with the prefix (bottom-right aligned mask)
        k_dense, v_dense = dense_kv(k_cache, page_table, total), dense_kv(v_cache, page_table, total)
        q4 = q.view(num_prompts, new_tokens, H_Q, HEAD_DIM).transpose(1, 2)
        if prefix == 0:
            sdpa_ms = bench(cfg, lambda: torch.nn.functional.scaled_dot_product_attention(
                q4, k_dense, v_dense, is_causal=True, scale=scale, enable_gqa=True))
        else:
            sdpa_ms = float("nan")
        visible = sum(prefix + i + 1 for i in range(new_tokens))  # kv positions summed over queries
        flops = 4 * num_prompts * H_Q * HEAD_DIM * visible
        nbytes = (2 * q.numel() + num_prompts * total * H_KV * HEAD_DIM * 2) * ELEM
        floor_ms = max(nbytes / ceil_bw, flops / ceil_flops) * 1e3
        rows.append(Row(f"extend {num_prompts}x{new_tokens} prefix={prefix}", ms, float("nan"), nbytes / 1e9, flops / 1e9,
                        floor_ms, sdpa_ms, err))
        del pool, k_dense, v_dense
    return rows


def small_kernel_rows(cfg: BenchConfig, ceil_bw: float, gen: torch.Generator):
    """Memory-bound helpers at a prefill-sized batch (4096 tokens, hidden 4096)."""
    from kernels.page_copy import gather_pages
    from kernels.rms_norm import rms_norm
    from kernels.silu_and_mul import silu_and_mul

    rows = []
    tokens, hidden, inter = cfg.small_tokens, cfg.small_hidden, cfg.small_inter
    x = torch.randn((tokens, hidden), device=cfg.device, dtype=cfg.dtype, generator=gen)
    res = torch.randn_like(x)
    w = torch.randn((hidden,), device=cfg.device, dtype=cfg.dtype, generator=gen)
    cases = [
        (f"rms_norm fused add {tokens}x{hidden}", lambda: rms_norm(x, w, 1e-6, res), 4 * x.numel() * ELEM),
    ]
    gate_up = torch.randn((tokens, 2 * inter), device=cfg.device, dtype=cfg.dtype, generator=gen)
    cases.append((f"silu_and_mul {tokens}x2x{inter}", lambda: silu_and_mul(gate_up), 1.5 * gate_up.numel() * ELEM))
    pool = torch.randn((cfg.gather_pool_pages, H_KV, cfg.gather_layers, 2, PAGE_SIZE, HEAD_DIM), device=cfg.device,
                       dtype=cfg.dtype, generator=gen)
    ids = torch.randperm(cfg.gather_pool_pages, device=cfg.device, generator=gen)[: cfg.gather_n]
    page_bytes = pool[0].numel() * ELEM
    cases.append((f"gather_pages {cfg.gather_n} x {page_bytes / 1e6:.1f}MB",
                  lambda: gather_pages(pool, ids), 2 * cfg.gather_n * page_bytes))
    for name, fn, nbytes in cases:
        ms = bench(cfg, fn)
        rows.append(Row(name, ms, float("nan"), nbytes / 1e9, 0.0, nbytes / ceil_bw * 1e3, float("nan"), float("nan")))
    return rows


def sweep(cfg: BenchConfig, gen: torch.Generator) -> list:
    """Compare tilings and split counts (GPU time via graph replay, L2 flushed),
    each checked against the reference on the timed shape and a ragged batch."""
    from kernels.decode_attention import decode_attention_reference
    from kernels.extend_attention import extend_attention_reference
    from loadtest.bench.random_paged_kv import random_paged_kv
    from kernels.triton_decode_attention import DecodeConfig, launch_decode_attention
    from kernels.triton_extend_attention import ExtendConfig, launch_extend_attention

    lines = []

    def say(line):
        print(line, flush=True)
        lines.append(line)

    scale = 1 / math.sqrt(HEAD_DIM)
    cpu = torch.Generator().manual_seed(1)
    ragged = random_paged_kv(list(cfg.sweep_decode_ragged), H_KV, HEAD_DIM, PAGE_SIZE, cfg.dtype, torch.device(cfg.device), cpu)
    q_ragged = torch.randn((len(cfg.sweep_decode_ragged), H_Q, HEAD_DIM), generator=cpu).to(cfg.device, cfg.dtype)
    r_args = (q_ragged, ragged.k_cache, ragged.v_cache, ragged.page_table, ragged.seq_lens, scale)
    r_ref = decode_attention_reference(*r_args)
    decode_cfgs = [DecodeConfig(64, 4, 2), DecodeConfig(32, 4, 2), DecodeConfig(64, 4, 3), DecodeConfig(128, 4, 2),
                   DecodeConfig(64, 8, 2), DecodeConfig(128, 8, 3), DecodeConfig(32, 2, 3), DecodeConfig(16, 4, 3)]
    decode_cfgs = decode_cfgs[: cfg.sweep_limit or None]
    say("decode sweep (ms, graph replay, ctx %d): config -> B=8 B=32 B=128 | ragged relerr" % cfg.decode_ctx)
    setups = []
    for batch in cfg.decode_batches[1:]:
        pool, page_table, seq_lens = paged_pool(cfg, batch, cfg.decode_ctx, gen)
        q = torch.randn((batch, H_Q, HEAD_DIM), device=cfg.device, dtype=cfg.dtype, generator=gen)
        setups.append((q, pool[:, :, 1, 0], pool[:, :, 1, 1], page_table, seq_lens, scale))
    for dc in decode_cfgs:
        times = []
        for args in setups:
            out = torch.empty_like(args[0])
            times.append(bench_replay(cfg, lambda: launch_decode_attention(*args, out=out, config=dc)))
        errs = [rel_err(launch_decode_attention(*r_args, num_kv_splits=sp, config=dc), r_ref) for sp in (None, 3)]
        say(f"  {dc} -> " + " ".join(f"{t:.4f}" for t in times) + f" | {max(errs):.1e}")
    say("decode split count (ms, default config): B -> splits:ms")
    for batch in cfg.decode_batches[:3]:
        pool, page_table, seq_lens = paged_pool(cfg, batch, cfg.decode_ctx, gen)
        q = torch.randn((batch, H_Q, HEAD_DIM), device=cfg.device, dtype=cfg.dtype, generator=gen)
        args = (q, pool[:, :, 1, 0], pool[:, :, 1, 1], page_table, seq_lens, scale)
        out = torch.empty_like(q)
        cells = [f"{sp}:{bench_replay(cfg, lambda: launch_decode_attention(*args, num_kv_splits=sp, out=out)):.4f}"
                 for sp in (1, 2, 4, 8, 16, 32)[: (cfg.sweep_limit + 1) if cfg.sweep_limit else None]]
        say(f"  B={batch} -> " + " ".join(cells))
        del pool

    ext, pre = (list(x) for x in cfg.sweep_extend_ragged)
    eragged = random_paged_kv([e + p for e, p in zip(ext, pre)], H_KV, HEAD_DIM, PAGE_SIZE, cfg.dtype,
                              torch.device(cfg.device), cpu)
    eq = torch.randn((sum(ext), H_Q, HEAD_DIM), generator=cpu).to(cfg.device, cfg.dtype)
    indptr = torch.tensor([0] + torch.tensor(ext).cumsum(0).tolist(), dtype=torch.int32, device=cfg.device)
    e_args = (eq, eragged.k_cache, eragged.v_cache, eragged.page_table, indptr, eragged.seq_lens, scale)
    e_ref = extend_attention_reference(*e_args)
    extend_cfgs = [ExtendConfig(128, 64, 8, 3), ExtendConfig(128, 64, 8, 2), ExtendConfig(128, 64, 4, 3),
                   ExtendConfig(128, 128, 8, 3), ExtendConfig(128, 128, 8, 2), ExtendConfig(64, 64, 4, 3),
                   ExtendConfig(128, 32, 8, 4), ExtendConfig(64, 128, 4, 2), ExtendConfig(128, 64, 8, 4)]
    extend_cfgs = extend_cfgs[: cfg.sweep_limit or None]
    say("extend sweep (ms, prefix 0): config -> 1x2048 4x2048 | ragged relerr")
    esetups = []
    for prompts in (1, 4)[: 1 if cfg.sweep_limit else None]:
        new = cfg.extend_cases[0][1]
        pool, page_table, seq_lens = paged_pool(cfg, prompts, new, gen)
        q = torch.randn((prompts * new, H_Q, HEAD_DIM), device=cfg.device, dtype=cfg.dtype, generator=gen)
        indptr_p = torch.arange(0, prompts + 1, device=cfg.device, dtype=torch.int32) * new
        esetups.append(((q, pool[:, :, 1, 0], pool[:, :, 1, 1], page_table, indptr_p, seq_lens, scale), new))
    for ec in extend_cfgs:
        try:
            times = []
            for args, new in esetups:
                out = torch.empty_like(args[0])
                times.append(bench(cfg, lambda: launch_extend_attention(*args, new, out=out, config=ec)))
            err = rel_err(launch_extend_attention(*e_args, max(ext), config=ec), e_ref)
            say(f"  {ec} -> " + " ".join(f"{t:.4f}" for t in times) + f" | {err:.1e}")
        except Exception as exc:  # e.g. out of shared memory for a tiling
            say(f"  {ec} -> failed: {type(exc).__name__}: {str(exc)[:120]}")
    return lines


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_kernels.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU with TRITON_INTERPRET=1")
    parser.add_argument("--sweep", action="store_true", help="also compare tilings and split counts")
    args = parser.parse_args()
    cfg = BenchConfig.smoke() if args.smoke else BenchConfig()
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    import triton

    gen = torch.Generator(device=cfg.device).manual_seed(0)
    name = torch.cuda.get_device_properties(0).name if cfg.device == "cuda" else "cpu (interpreter)"
    print(f"device {name}; torch {torch.__version__}, triton {triton.__version__}")
    ceil_bw, ceil_flops = copy_bandwidth(cfg), matmul_rate(cfg)
    print(f"ceilings: copy {ceil_bw / 1e12:.2f} TB/s (read+write), bf16 matmul {ceil_flops / 1e12:.0f} TFLOP/s")
    rows = decode_rows(cfg, ceil_bw, ceil_flops, gen) + extend_rows(cfg, ceil_bw, ceil_flops, gen)
    rows += small_kernel_rows(cfg, ceil_bw, gen)
    header = f"{'kernel':36s} {'ms':>8s} {'eager':>7s} {'GB/s':>7s} {'TFLOP/s':>8s} {'floor':>8s} {'x floor':>7s} {'sdpa':>8s} {'relerr':>8s}"
    print(header)
    for r in rows:
        print(f"{r.name:36s} {r.ms:8.4f} {r.eager_ms:7.4f} {r.gb_s:7.0f} {r.tflop_s:8.1f} {r.floor_ms:8.4f} "
              f"{r.floor_ratio:7.2f} {r.sdpa_ms:8.4f} {r.rel_err:8.1e} {r.note}")
    sweep_lines = sweep(cfg, gen) if args.sweep else []
    with open(args.json, "w") as f:
        json.dump({"device": name, "copy_bytes_per_s": ceil_bw, "bf16_flops_per_s": ceil_flops,
                   "rows": [asdict(r) | {"gb_s": r.gb_s, "tflop_s": r.tflop_s} for r in rows],
                   "sweep": sweep_lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
