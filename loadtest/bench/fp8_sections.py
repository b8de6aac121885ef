"""The FP8 sections of `duet bench --suite fp8` (`python -m loadtest.bench.fp8_device` runs
them). Random weights of real shapes (Qwen3-8B, Qwen3-30B-A3B), made FP8 at load
(--quantization fp8 over --load-format dummy: the FP8 values are drawn directly).

Sections (each its own try/except; a section that fails prints its error and the run goes on;
sections not started when the budget is spent are listed as skipped; a watchdog prints the
table and exits if one hangs):
  ceilings        copy bandwidth, bf16 matmul, FP8 matmul peak (torch._scaled_mm e4m3)
  fp8_accuracy    (a) 8B shape, 512-token teacher-forced prompt: logits of the GPU path vs the
                  same weights dequantized (float32 engine): cosine and top-1 agreement, for
                  bf16 compute on those weights (the yardstick),
                  FP8 weights (one-shot prefill: W8A8 GEMMs), FP8 weights + FP8 KV, and both in
                  8-token chunks (the decode-size kernels reading FP8 pages); random weights
                  are too flat to judge it: trained ones, on the CPU, in fp8_accuracy_cpu.py
  fp8_decode_8b   (b) 8B decode B=1, 32 (ctx 1024): FP8 vs its floor in FP8 bytes and vs bf16;
                  engine prefill 4x2048 FP8 vs bf16
  fp8_gemm        (d) W8A8 GEMM at the 8B linears: M=8192 (prefill) vs torch._scaled_mm on the same
                  shape and vs the measured FP8 peak, M=32 (decode) in GB/s; the tilings of
                  GEMM_TILINGS; per-tile vs per-column weight scales; the quantize kernel's time
  fp8_gemm_cublas cuBLAS's block-scaled GEMM (fp8_linear's route from 128 rows where it applies)
                  against the Triton W8A8 GEMM at the 8B linears, M = 64..8192: TFLOP/s, % of peak, error
  fp8_decode_8b_wide  8B decode B=64, 128: FP8 with cuBLAS's GEMM, FP8 on the Triton GEMM, bf16
  fp8_decode_route  8B FP8 decode B=1, 8, 32 on the W8A8 decode GEMM and with it off (W8A16 to 32 rows)
  fp8_decode_prequant  8B FP8 decode B=8..32: the decode GEMM's x quantized before it from 17
                  rows (default), from 9, never (PREQUANT_MIN_M)
  fp8_norm_quant  8B FP8 decode B=2..32: the norms before qkv and gate/up writing x in FP8 for the
                  decode GEMM from 2 rows, from 17 (default), never (FUSED_QUANT_MIN_M)
  fp8_decode_gemm_64  8B FP8 decode B=32, 48, 64: the decode GEMM taking up to 64 rows against 32
                  (FP8_DECODE_MAX_M)
  fp8_pdl_past_one_row  8B FP8 decode B=1..32: PDL on one-row launches, and to 32 rows with the
                  linears and attention signalling late to 16 rows (default), never, to 32 rows
  fp8_pdl_wait_first  decode, 8B FP8 B=1..32, bf16 B=1, 30B-A3B FP8 B=1..32: PDL's short kernels waiting
                  before they signal (default) and before (on entry; x's quantization without PDL)
  fp8_pdl_orders  8B decode: at one row short kernels signalling on entry, or every kernel waiting
                  first, FP8 and bf16; past 16 rows loop kernels signalling late to 32
  fp8_pdl_late_linear  8B decode B=1: one linear at a time signalling after its loop, FP8 (and bf16 gate/up)
  fp8_pdl_prefetch  8B decode B=1 (FP8 also B=8), FP8 and bf16, with the linears prefetching 0, 1, 2 or 4
                  weight tiles under PDL
  fp8_decode_profile  8B FP8 decode B=32 and 64: step, GPU busy time, heaviest kernels
  fp8_decode_timeline  8B decode B=1 and 32, FP8 and bf16: a step's kernels on one time line
                  (decode_timeline.py): busy and idle time, kernels a step, the heaviest by name
  fp8_attn_prefetch  8B decode B=1, FP8 and bf16, with decode attention's K/V prefetch under PDL
                  on and off (kernels/triton_decode_attention.py PDL_KV_PREFETCH)
  fp8_attn_prefetch_rows  8B FP8 decode B=1..32 with attention's K/V prefetch under PDL to 1, 2, 8, 32 rows
  fp8_moe_decode  (c) 30B-A3B decode B=1, 8, 32: FP8 vs floor (touched experts) and bf16
  fp8_moe_timeline  30B-A3B FP8 decode B=1 and 8: a step's kernels on one time line
  fp8_moe_pairs   30B-A3B FP8 decode B=2..6 with the per-pair experts kernel to 2 tokens and to 4
  fp8_moe_pdl_rows  30B-A3B decode B=1..32, FP8 and bf16, with PDL on one-row launches and to 32 rows
  fp8_kv_long     (e) 8B FP8 weights, ctx 16k: step time and KV pages with FP8 vs bf16 KV in
                  one budget (B=16 both, B=32 FP8 only: bf16 does not fit an H100), bytes per
                  token a handoff moves
  fp8_prefill_profile  8B prefill step of 4x2048 tokens, FP8 vs bf16: the kernels taking the most
                  GPU time (torch.profiler)
The table comes last (and --json). The PDL sections (fp8_pdl_*, fp8_attn_prefetch*, fp8_moe_pdl_rows)
live in fp8_pdl_sections.py; the loop several sections share (an engine per setting, decode steps,
greedy tokens) in fp8_steps.py."""
from __future__ import annotations

import torch

from .fp8_pdl_sections import PDL_SECTIONS
from .fp8_steps import bench_engine, fp8_steps_by_setting

QWEN3_8B_PREFILL = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


# -- helpers ------------------------------------------------------------------------------------
def teacher_forced_logits(engine, tokens: list[int], chunk: int | None = None) -> torch.Tensor:
    """float32 logits [len(tokens) - 1, V], row j predicting token j + 1, from one prefill of
    `tokens` (prompt logprobs keep every row); chunk: the step's token budget (chunked)."""
    from shared.engine import SamplingParams

    captured: list[torch.Tensor] = []
    model = engine.model
    plain = model.compute_logits

    def grab(h):
        out = plain(h)
        captured.append(out.float())
        return out

    model.compute_logits = grab
    budget = engine.scheduler.max_batched_tokens
    if chunk:
        engine.scheduler.max_batched_tokens = chunk
    try:
        engine.add_request(tokens, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True))
        while engine.has_work:
            engine.step()
    finally:
        del model.compute_logits
        engine.scheduler.max_batched_tokens = budget
    return torch.cat(captured)[:len(tokens) - 1]


def compare_logits(got: torch.Tensor, ref: torch.Tensor) -> dict:
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    top = (got.argmax(-1) == ref.argmax(-1)).float()
    ref_top2 = ref.topk(2, dim=-1).values
    clear = (ref_top2[:, 0] - ref_top2[:, 1]) > 0.1 * ref.std(dim=-1)  # positions with a margin
    return dict(cos_mean=cos.mean().item(), cos_min=cos.min().item(), top1=top.mean().item(),
                top1_clear=top[clear].mean().item() if clear.any() else float("nan"),
                clear_share=clear.float().mean().item())


def copy_dequantized(src_model, dst_model) -> None:
    """dst (a 16/32-bit model of the same shape) takes src's weights: FP8 ones dequantized."""
    from shared.engine.quantization.fp8_params import fp8_weight

    dst = dict(dst_model.named_modules())
    with torch.no_grad():
        for name, m in src_model.named_modules():
            fp8 = getattr(m, "fp8", None) or {}
            for pname, p in m.named_parameters(recurse=False):
                if pname.endswith("_scale"):
                    continue
                target = getattr(dst[name], pname)
                value = fp8_weight(m, pname).dequantize(target.dtype) if pname in fp8 else p.data
                target.data.copy_(value)


def _time_ms(fn, reps: int = 20) -> float:
    from .shapes import _time_ms as t
    for _ in range(3):
        fn()
    return t(fn, reps)


# -- sections -----------------------------------------------------------------------------------
def fp8_accuracy(ctx):
    from .gpu_engine import release_memory
    from .suite_context import random_engine as _engine

    rep = ctx["report"]
    common = dict(max_model_len=1024, kv_cache_memory=2 << 30)
    fp8 = _engine(ctx, "qwen3-8b", quantization="fp8", cuda_graph=False, **common)
    ref = _engine(ctx, "qwen3-8b", dtype="float32", cuda_graph=False, **common)
    copy_dequantized(fp8.model, ref.model)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(10, fp8.model_config.vocab_size - 10, (512,), generator=g).tolist()
    want = teacher_forced_logits(ref, tokens)
    want_chunked = teacher_forced_logits(ref, tokens, chunk=8)
    rep.add("fp8_accuracy", "reference chunked vs one-shot cos_min",
            compare_logits(want_chunked, want)["cos_min"], "float32 engine with itself: the noise floor")
    ref.close()
    del ref
    release_memory()
    # bf16 compute on the same (dequantized) weights: how far 16-bit activations alone drift on
    # this random-weight model, the yardstick for FP8's own error
    bf16 = _engine(ctx, "qwen3-8b", cuda_graph=False, **common)
    copy_dequantized(fp8.model, bf16.model)
    r = compare_logits(teacher_forced_logits(bf16, tokens), want)
    rep.add("fp8_accuracy", "bf16 (same weights) cos_mean", r["cos_mean"],
            f"min {r['cos_min']:.4f}, top1 {r['top1']:.3f}: 16-bit compute alone, the yardstick")
    bf16.close()
    del bf16
    release_memory()
    runs = [("fp8 weights", fp8, None)]
    fp8kv = _engine(ctx, "qwen3-8b", quantization="fp8", kv_cache_dtype="fp8_e4m3", cuda_graph=False, **common)
    runs.append(("fp8 weights + fp8 kv", fp8kv, None))
    runs += [("fp8 weights, 8-token chunks", fp8, 8), ("fp8 weights + fp8 kv, 8-token chunks", fp8kv, 8)]
    for label, eng, chunk in runs:
        r = compare_logits(teacher_forced_logits(eng, tokens, chunk), want_chunked if chunk else want)
        ok = r["cos_mean"] >= 0.99 and r["top1"] >= 0.95
        rep.add("fp8_accuracy", f"{label} cos_mean", r["cos_mean"], f"min {r['cos_min']:.4f}; aim >= 0.99")
        rep.add("fp8_accuracy", f"{label} top1", r["top1"],
                f"{'meets' if ok else 'misses'} the aim (>= 0.95); {r['top1_clear']:.3f} where the reference's "
                f"top-2 margin > 0.1 sd ({100 * r['clear_share']:.0f}% of positions)")
    _gemm_error(rep, fp8.model)
    for e in (fp8, fp8kv):
        e.close()
    del fp8, fp8kv, runs
    release_memory()


def _gemm_error(rep, model) -> None:
    """One FP8 linear of the model at prefill sizes: the Triton W8A8 path against its torch
    reference (the same quantization), and what quantizing the activations costs against the
    unquantized product. A random-weight model amplifies any per-GEMM difference over its
    layers (bf16 compute alone moves top-1), so these rows say whether the kernels are right."""
    import kernels.fp8_linear as fl
    from shared.engine.quantization.fp8_params import fp8_weight

    name, module = next((n, m) for n, m in model.named_modules() if getattr(m, "fp8", None))
    pname = next(iter(module.fp8))
    w = fp8_weight(module, pname)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for rows in (512, 4096):
        x = torch.randn(rows, w.q.shape[1], device=w.q.device, dtype=torch.bfloat16)
        ref = fl.fp8_linear_reference(x, w)
        exact = x.double() @ w.dequantize(torch.float64).T
        rep.add("fp8_accuracy", f"{name}.{pname} M={rows} kernel vs reference", rel(fl.fp8_linear(x, w), ref),
                f"activation rounding (reference vs unquantized activations): {rel(ref, exact):.4f}")


def _decode_fp8_and_bf16(ctx, section: str, model: str, batches, aim: str = "", each_engine=None, **engine_kw):
    """One model's engine with FP8 weights, then with bf16: its weight bytes and the decode step
    at each batch against its bytes floor; each_engine(tag, eng) measures what else the section
    wants before the engine is freed. Returns {(tag, batch): step ms}."""
    from .gpu_engine import decode_floor_ms, decode_step_ms, release_memory
    from .suite_context import need_ceilings as _need_ceilings, random_engine as _engine

    args, rep = ctx["args"], ctx["report"]
    c = _need_ceilings(ctx)
    got = {}
    for tag, options in (("fp8", dict(quantization="fp8")), ("bf16", {})):
        eng = _engine(ctx, model, **engine_kw, **options)
        rep.add(section, f"{tag} weights GiB", round(eng.weight_bytes / 2 ** 30, 2), eng.weights_description)
        for b in batches:
            floor, gb = decode_floor_ms(eng, b, args.ctx, c.copy_gb_s)
            ms = decode_step_ms(eng, b, args.ctx, args.steps, overlap=True)
            got[(tag, b)] = ms
            rep.add(section, f"{tag} B={b} step_ms", ms,
                    f"floor {floor:.3f} ms ({gb:.2f} GB read), x{ms / floor:.2f} of floor{aim}")
        if each_engine is not None:
            each_engine(tag, eng)
        eng.close()
        del eng
        release_memory()
    return got


def fp8_decode_8b(ctx):
    from .gpu_engine import prefill_rate

    rep = ctx["report"]
    prefill = {}

    def prefill_of(tag, eng):
        prefill_rate(eng, 4, 2048, seed=99)  # warm-up of the same shape: every kernel the step runs is compiled
        r = prefill_rate(eng, 4, 2048, seed=4)
        prefill[tag] = r["tok_s"]
        rep.add("fp8_decode_8b", f"{tag} prefill 4x2048 tok_s", r["tok_s"], f"{r['tflops']:.0f} TFLOP/s")

    got = _decode_fp8_and_bf16(ctx, "fp8_decode_8b", "qwen3-8b", (1, 32), " (aim <= 1.2 for fp8)", prefill_of,
                               max_model_len=4096, cuda_graph_max_bs=32, kv_cache_memory=8 << 30)
    for b in (1, 32):
        rep.add("fp8_decode_8b", f"bf16/fp8 B={b}", got[("bf16", b)] / got[("fp8", b)],
                "aim >= 1.6 at B=1" if b == 1 else "")
    rep.add("fp8_decode_8b", "prefill fp8/bf16", prefill["fp8"] / prefill["bf16"])


def fp8_decode_8b_wide(ctx):
    """8B decode at B=64 and 128 (the W8A8 sizes), FP8 with the W8A8 products on cuBLAS's
    block-scaled GEMM (kernels/fp8_cublas.py), on the Triton GEMM, and bf16: where the route's
    row threshold belongs for CUDA-graphed decode batches."""
    import kernels.fp8_cublas as fc
    from .gpu_engine import decode_floor_ms, decode_step_ms
    from .suite_context import need_ceilings as _need_ceilings

    args, rep = ctx["args"], ctx["report"]
    c = _need_ceilings(ctx)
    batches = (64, 128)
    # every sequence resident: 128 x ~1.1k tokens x 144 KiB (bf16 KV) is ~20 GiB
    kw = dict(max_model_len=2048, cuda_graph_max_bs=128, kv_cache_memory=24 << 30)
    got = {}
    for tag, options, min_rows in (("fp8 cuBLAS", dict(quantization="fp8"), 33),
                                   ("fp8 Triton", dict(quantization="fp8"), 1 << 30), ("bf16", {}, fc.MIN_ROWS)):
        with bench_engine(ctx, (fc, "MIN_ROWS", min_rows), **kw, **options) as eng:
            for b in batches:
                floor, gb = decode_floor_ms(eng, b, args.ctx, c.copy_gb_s)
                ms = decode_step_ms(eng, b, args.ctx, args.steps, overlap=True)
                got[(tag, b)] = ms
                rep.add("fp8_decode_8b_wide", f"{tag} B={b} step_ms", ms, f"floor {floor:.3f} ms, x{ms / floor:.2f}")
    for b in batches:
        rep.add("fp8_decode_8b_wide", f"B={b} Triton/cuBLAS", got[("fp8 Triton", b)] / got[("fp8 cuBLAS", b)],
                f"bf16/fp8 cuBLAS {got[('bf16', b)] / got[('fp8 cuBLAS', b)]:.2f}")


def fp8_decode_route(ctx):
    """8B FP8 decode at B=1, 8, 32 with decode sizes on the W8A8 decode GEMM (x quantized in
    the kernel, kernels/fp8_decode_gemm.py) and with it off (the W8A16 small-batch kernel up to 32
    rows, the M-tiled W8A8 GEMM above): the same engine build, one route each."""
    import kernels.fp8_decode_gemm as fd

    batches = (1, 8, 32)
    got = fp8_steps_by_setting(ctx, "fp8_decode_route", [
        ("decode GEMM", (fd, "FP8_DECODE_MAX_M", fd.FP8_DECODE_MAX_M)),
        ("W8A16 small-batch", (fd, "FP8_DECODE_MAX_M", 0))], batches)
    for b in batches:
        ctx["report"].add("fp8_decode_route", f"B={b} small-batch/decode GEMM",
                          got[("W8A16 small-batch", b)] / got[("decode GEMM", b)])


def fp8_decode_prequant(ctx):
    """8B FP8 decode at B=8, 16, 24, 32 with the decode GEMM's x quantized once before it from 17
    rows (the default, kernels/fp8_decode_gemm.py PREQUANT_MIN_M), from 9 rows, and never (each
    program quantizing its x slice every K step): one engine build each."""
    import kernels.fp8_decode_gemm as fd

    batches = (8, 16, 24, 32)
    got = fp8_steps_by_setting(ctx, "fp8_decode_prequant", [
        (tag, (fd, "PREQUANT_MIN_M", min_m))
        for tag, min_m in (("in-kernel", 33), ("prequant from 17", 17), ("prequant from 9", 9))], batches)
    for b in batches:
        for tag in ("prequant from 17", "prequant from 9"):
            ctx["report"].add("fp8_decode_prequant", f"B={b} in-kernel/{tag}", got[("in-kernel", b)] / got[(tag, b)])


def fp8_norm_quant(ctx):
    """8B FP8 decode at B=2, 8, 16, 32 with the RMSNorms before qkv and gate/up writing their
    output in FP8 for the decode GEMM (kernels.rms_norm.rms_norm_fp8_rows) from 2 rows, from 17
    (the default, kernels/fp8_decode_gemm.py FUSED_QUANT_MIN_M), and never (the GEMM
    quantizing x itself, by its own launch from 17 rows): one engine build each, and 8 rows'
    greedy tokens in the graphs, which must be equal (the same FP8 bytes reach the same dots)."""
    import kernels.fp8_decode_gemm as fd

    from .decode_timeline import decode_timeline

    args, rep = ctx["args"], ctx["report"]
    tags = ("norm from 2", "norm from 17", "GEMM quantizes")

    def time_line(eng, tag):
        for b in (8, 32):  # where the time moves: the norms, the quantize launches, the GEMMs
            t = decode_timeline(eng, b, args.ctx)
            for k in t.kernels:
                if any(n in k.name for n in ("rms_norm", "quantize_x", "decode_gemm", "small_batch")):
                    rep.add("fp8_norm_quant", f"{tag} B={b} {k.name[:40]}", round(k.us_per_step, 1),
                            f"us a step in {k.launches_per_step:.0f} launches")
            rep.add("fp8_norm_quant", f"{tag} B={b} GPU busy a step ms", t.busy_ms, f"span {t.step_ms:.3f}")

    batches = (2, 8, 16, 32)
    got = fp8_steps_by_setting(ctx, "fp8_norm_quant", [
        (tag, (fd, "FUSED_QUANT_MIN_M", min_m)) for tag, min_m in zip(tags, (2, 17, 33))], batches,
        greedy_rows=8, after=time_line)
    for b in batches:
        for tag in tags[:2]:
            rep.add("fp8_norm_quant", f"B={b} GEMM quantizes/{tag}", got[("GEMM quantizes", b)] / got[(tag, b)])
    same = all(got[(t, "tokens")] == got[("GEMM quantizes", "tokens")] for t in tags[:2])
    rep.add("fp8_norm_quant", "8 rows' greedy tokens equal", "yes" if same else "NO", "64 tokens each, CUDA graphs")


def fp8_decode_gemm_64(ctx):
    """8B FP8 decode at B=32, 48, 64: the decode GEMM (x quantized before it) taking up to 64 rows
    against the route now (up to 32; past it per_token_group_quant and the M-tiled W8A8 GEMM):
    kernels/fp8_decode_gemm.py FP8_DECODE_MAX_M, one engine build each."""
    import kernels.fp8_decode_gemm as fd

    batches = (32, 48, 64)
    got = fp8_steps_by_setting(ctx, "fp8_decode_gemm_64", [
        (f"decode GEMM to {m}", (fd, "FP8_DECODE_MAX_M", m)) for m in (32, 64)], batches, kv_cache_memory=12 << 30)
    for b in batches:
        ctx["report"].add("fp8_decode_gemm_64", f"B={b} to 32 / to 64",
                          got[("decode GEMM to 32", b)] / got[("decode GEMM to 64", b)])


def fp8_decode_profile(ctx):
    """8B FP8 decode at B=32 and 64 (one engine, graphs up to 128): the step, the GPU busy time a
    step and its heaviest kernels (torch.profiler over 8 steps): why B=32 measured slower than 64."""
    from .gpu_engine import decode_step_ms

    args, rep = ctx["args"], ctx["report"]
    with bench_engine(ctx, quantization="fp8", max_model_len=2048, cuda_graph_max_bs=128,
                    kv_cache_memory=8 << 30) as eng:
        for b in (32, 64):
            ms = decode_step_ms(eng, b, args.ctx, args.steps, overlap=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                decode_step_ms(eng, b, args.ctx, 8, warm=2, overlap=True)
            events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
            steps = 8 + 2 + 2  # the profiled call's warm and timed steps, and its first token's
            total = sum(e.self_device_time_total for e in events) / 1e3
            rep.add("fp8_decode_profile", f"B={b} step_ms", ms, f"GPU busy {total:.1f} ms over the profiled call")
            for e in events[:7]:
                rep.add("fp8_decode_profile", f"B={b} {e.key[:56]}", e.self_device_time_total / 1e3,
                        f"ms in {e.count} launches (~{steps} steps)")


def fp8_decode_timeline(ctx):
    """Where an 8B decode step's time goes at B=1 and 32, FP8 weights and bf16: kernel time by
    name, idle time between kernels, kernels a step (torch.profiler over 8 steady steps)."""
    from .decode_timeline import decode_timeline

    args, rep = ctx["args"], ctx["report"]
    for tag, options in (("fp8", dict(quantization="fp8")), ("bf16", {})):
        with bench_engine(ctx, max_model_len=2048, cuda_graph_max_bs=32, kv_cache_memory=8 << 30, **options) as eng:
            for b in (1, 32):
                t = decode_timeline(eng, b, args.ctx)
                rep.add("fp8_decode_timeline", f"{tag} B={b} GPU span a step ms", t.step_ms,
                        f"busy {t.busy_ms:.3f}, idle {t.idle_ms:.3f}; {t.kernels_per_step:.0f} kernels, "
                        f"{t.bubbles_per_step:.0f} gaps over 5 us")
                for k in t.kernels[:8 if b == 1 else 5]:
                    rep.add("fp8_decode_timeline", f"{tag} B={b} {k.name[:48]}", round(k.us_per_step, 1),
                            f"us a step in {k.launches_per_step:.0f} launches (longest {k.longest_us:.1f} us)")
                for us, before, after in t.gaps[:3]:
                    rep.add("fp8_decode_timeline", f"{tag} B={b} idle gap us", round(us, 1), f"{before} -> {after}")


# W8A8 tilings tried (block_m, block_n, group_m, warps, stages, tma, k_pairs); block_k is the 128 group
GEMM_TILINGS = {
    8192: [(128, 128, 8, 8, 4, False, False), (128, 128, 8, 8, 4, True, False), (128, 128, 8, 8, 3, True, True),
           (64, 128, 8, 4, 4, False, False), (64, 128, 8, 4, 4, True, False), (64, 128, 8, 4, 4, True, True),
           (64, 128, 8, 4, 3, True, True), (128, 128, 8, 4, 3, True, True), (64, 256, 8, 8, 3, True, False)],
    32: [(64, 128, 1, 4, 4, False, False), (64, 64, 1, 4, 6, True, False), (64, 64, 1, 4, 8, True, False),
         (64, 32, 1, 4, 6, True, False), (64, 32, 1, 4, 8, True, False), (64, 32, 1, 4, 4, True, True)],
}
L2_FLUSH_BYTES = 128 << 20  # decode sizes rotate over weight copies this large, as a decode step reads HBM


def fp8_gemm(ctx):
    """(d) The W8A8 GEMM at the 8B linears: M=8192 (a prefill step) against the FP8 peak and
    _scaled_mm on the same shape; M=32 (a decode batch) in GB/s of weights against the copy
    bandwidth, timed in CUDA graphs as decode runs, beside the W8A16 small-batch kernel that
    fp8_linear routes decode sizes to. Each tiling of GEMM_TILINGS, the best, the best with a
    scale a column (tile_n=0: what per-tile scales save), and the activation quantization."""
    from kernels.fp8 import FP8_DTYPE, Fp8Weight, block_scale_rows
    from kernels.fp8_linear import Fp8GemmConfig, fp8_linear, gemm_config, per_token_group_quant, w8a8_gemm
    from kernels.small_batch_linear import SmallBatchWorkspace
    from .shapes import scaled_mm
    from .suite_context import need_ceilings as _need_ceilings

    rep = ctx["report"]
    c = _need_ceilings(ctx)
    dev = ctx["dev"]
    ws_small = SmallBatchWorkspace.create(dev)
    for m, tilings in GEMM_TILINGS.items():
        decode = m <= 64
        time_of = _graph_ms if decode else _time_ms
        x = torch.randn(m, 12288, device=dev, dtype=torch.bfloat16)
        for name, (n, k) in QWEN3_8B_PREFILL.items():
            copies = max(1, -(-L2_FLUSH_BYTES // (n * k))) if decode else 1
            ws = [Fp8Weight(torch.randn(n, k, device=dev).to(FP8_DTYPE), torch.rand(-(-n // 128), -(-k // 128),
                            device=dev), block_scale_rows(n, 128).to(dev), 128, 128) for _ in range(copies)]
            xk = x[:, :k].contiguous()
            xq, xs = per_token_group_quant(xk)
            flops, wbytes = 2 * m * n * k, n * k

            def timed(cfg, tile_n=128):
                wt = [Fp8Weight(w.q, w.scale, w.scale_row, 128, tile_n) for w in ws]
                return time_of(lambda: [w8a8_gemm(xq, xs, w, out_dtype=torch.bfloat16, config=cfg)
                                        for w in wt]) / copies

            results = {}
            for t in [None] + [Fp8GemmConfig(bm, bn, 128, *rest) for bm, bn, *rest in tilings]:
                cfg = t or gemm_config(m, n, 128, dev)
                try:
                    results[cfg] = timed(cfg)
                except Exception as e:  # noqa: BLE001 - a tiling that does not fit is not an error
                    rep.add("fp8_gemm", f"{name} M={m} {_tiling(cfg)} failed", type(e).__name__)
            default_ms = results[gemm_config(m, n, 128, dev)]
            best_cfg = min(results, key=results.get)
            best = results[best_cfg]
            per_column = timed(best_cfg, tile_n=0)
            quant = time_of(lambda: per_token_group_quant(xk))
            if not decode:
                cublas = _time_ms(lambda: scaled_mm(xq, ws[0].q))
                tf = flops / best / 1e9
                rep.add("fp8_gemm", f"{name} M={m} N={n} K={k} TFLOPs", tf,
                        f"{100 * tf / c.fp8_matmul_tflops:.0f}% of FP8 peak (aim >= 70), _scaled_mm same shape "
                        f"{flops / cublas / 1e9:.0f} TFLOP/s (per-tensor scales), default tiling "
                        f"{flops / default_ms / 1e9:.0f}, scale a column {flops / per_column / 1e9:.0f}, best "
                        f"{_tiling(best_cfg)}")
            else:
                w8a16 = time_of(lambda: [fp8_linear(xk, w, workspace=ws_small) for w in ws]) / copies
                gbs = wbytes / best / 1e6
                rep.add("fp8_gemm", f"{name} M={m} N={n} K={k} W8A8 us", best * 1e3,
                        f"{gbs:.0f} GB/s of FP8 weights, {100 * gbs / c.copy_gb_s:.0f}% of copy; default tiling "
                        f"{default_ms * 1e3:.1f} us, scale a column {per_column * 1e3:.1f} us, best {_tiling(best_cfg)}")
                rep.add("fp8_gemm", f"{name} M={m} W8A16 small-batch us", w8a16 * 1e3,
                        f"{wbytes / w8a16 / 1e6:.0f} GB/s (fp8_linear's decode route; W8A8 adds the quantize)")
            rep.add("fp8_gemm", f"{name} M={m} quantize us", quant * 1e3,
                    f"{3 * m * k / quant / 1e6:.0f} GB/s (bf16 in, fp8 out)")
            rep.data.setdefault("fp8_gemm_tilings", {})[f"{name} M={m}"] = {
                _tiling(cfg): round(ms * 1e3, 1) for cfg, ms in sorted(results.items(), key=lambda kv: kv[1])}
        del x


def fp8_gemm_cublas(ctx) -> None:
    """(d') cuBLAS's block-scaled GEMM (kernels/fp8_cublas.py, fp8_linear's long-prefill route where it
    applies) against the Triton W8A8 GEMM's default tiling, at the 8B linears and M = 64..8192
    (up to 256 rows in CUDA graphs, as decode batches run; the weight L2-warm for both):
    TFLOP/s, % of the FP8 peak, and its error against the W8A8 reference."""
    from kernels.fp8 import FP8_DTYPE, Fp8Weight, block_scale_rows
    from kernels.fp8_cublas import available, cublas_w8a8, weight_fits
    from kernels.fp8_linear import per_token_group_quant, w8a8_gemm, w8a8_gemm_reference
    from .suite_context import need_ceilings as _need_ceilings

    rep, dev = ctx["report"], ctx["dev"]
    c = _need_ceilings(ctx)
    for m in (64, 128, 256, 1024, 2048, 8192):
        x = torch.randn(m, 12288, device=dev, dtype=torch.bfloat16)
        for name, (n, k) in QWEN3_8B_PREFILL.items():
            w = Fp8Weight(torch.randn(n, k, device=dev).to(FP8_DTYPE), torch.rand(n // 128, k // 128, device=dev),
                          block_scale_rows(n, 128).to(dev), 128, 128)
            xk = x[:, :k].contiguous()
            if not (weight_fits(w) and available(xk.device)):  # the route's row threshold aside
                rep.add("fp8_gemm_cublas", f"{name} M={m}", "not routed", "the probe or the layout check refused it")
                continue
            xq, xs = per_token_group_quant(xk, m_major=True)
            xs_rows = xs.contiguous()
            flops = 2 * m * n * k
            # decode-batch sizes run in CUDA graphs (eager, both sides were mostly launch cost)
            time_of = _graph_ms if m <= 256 else _time_ms
            try:
                cub = time_of(lambda: cublas_w8a8(xq, xs, w))
            except RuntimeError as e:
                rep.add("fp8_gemm_cublas", f"{name} M={m}", "failed", str(e)[:120])
                continue
            tri = time_of(lambda: w8a8_gemm(xq, xs_rows, w))
            q2, s2 = per_token_group_quant(xk[:256], m_major=True)
            ref = w8a8_gemm_reference(q2, s2, w).double()
            err = ((cublas_w8a8(q2, s2, w).double() - ref).norm() / ref.norm()).item()
            tf = flops / cub / 1e9
            rep.add("fp8_gemm_cublas", f"{name} M={m} TFLOPs", tf,
                    f"{100 * tf / c.fp8_matmul_tflops:.0f}% of FP8 peak; Triton W8A8 {flops / tri / 1e9:.0f} TFLOP/s "
                    f"({100 * flops / tri / 1e9 / c.fp8_matmul_tflops:.0f}%); rel err vs reference {err:.1e}")
        del x


def _graph_ms(fn, reps: int = 20) -> float:
    from .small_batch_linear import graph_replay_ms

    return graph_replay_ms([fn], reps)


def _tiling(cfg) -> str:
    return (f"{cfg.block_m}x{cfg.block_n} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}"
            f"{' tma' if cfg.tma else ''}{' pairs' if cfg.k_pairs else ''}")


def fp8_prefill_profile(ctx):
    """Where an 8B prefill step of 8192 tokens spends GPU time, FP8 weights against bf16: the
    kernels with the most time (torch.profiler), after a warm-up step of the same shape."""
    from .gpu_engine import prefill_rate, release_memory
    from .suite_context import random_engine as _engine

    rep = ctx["report"]
    for tag, options in (("fp8", dict(quantization="fp8")), ("bf16", {})):
        eng = _engine(ctx, "qwen3-8b", max_model_len=4096, cuda_graph_max_bs=1, kv_cache_memory=8 << 30, **options)
        prefill_rate(eng, 4, 2048, seed=98)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            r = prefill_rate(eng, 4, 2048, seed=4)
        rep.add("fp8_prefill_profile", f"{tag} 4x2048 ms", r["sec"] * 1e3, f"{r['tok_s']:.0f} tok/s")
        events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
        total = sum(e.self_device_time_total for e in events)
        rep.add("fp8_prefill_profile", f"{tag} GPU busy ms", total / 1e3)
        for e in events[:8]:
            rep.add("fp8_prefill_profile", f"{tag} {e.key[:60]}", e.self_device_time_total / 1e3,
                    f"ms in {e.count} launches")
        eng.close()
        del eng
        release_memory()


def fp8_moe_decode(ctx):
    got = _decode_fp8_and_bf16(ctx, "fp8_moe_decode", "qwen3-30b-a3b", (1, 8, 32), max_model_len=2048,
                               cuda_graph_max_bs=32, kv_cache_memory=4 << 30)
    for b in (1, 8, 32):
        ctx["report"].add("fp8_moe_decode", f"bf16/fp8 B={b}", got[("bf16", b)] / got[("fp8", b)])


def fp8_moe_timeline(ctx):
    """Where a Qwen3-30B-A3B FP8 decode step's time goes at B=1 and 8 (x3.3 and x2.0 of its floor
    on an H200): kernel time by name, idle time, kernels a step (decode_timeline.py)."""
    from .decode_timeline import decode_timeline

    args, rep = ctx["args"], ctx["report"]
    with bench_engine(ctx, None, "qwen3-30b-a3b", quantization="fp8", max_model_len=2048, cuda_graph_max_bs=8,
                       kv_cache_memory=4 << 30) as eng:
        for b in (1, 8):
            t = decode_timeline(eng, b, args.ctx)
            rep.add("fp8_moe_timeline", f"B={b} GPU span a step ms", t.step_ms,
                    f"busy {t.busy_ms:.3f}, idle {t.idle_ms:.3f}; {t.kernels_per_step:.0f} kernels, "
                    f"{t.bubbles_per_step:.0f} gaps over 5 us")
            for k in t.kernels[:12]:
                rep.add("fp8_moe_timeline", f"B={b} {k.name[:48]}", round(k.us_per_step, 1),
                        f"us a step in {k.launches_per_step:.0f} launches (longest {k.longest_us:.1f} us)")


def fp8_moe_pairs(ctx):
    """30B-A3B FP8 decode at B=2, 3, 4, 6 with the per-pair experts kernel (W8A16) taking up to 2
    tokens (the 16-bit limit) and up to 4 (shared/engine/models/moe.py EXPERTS_DECODE_MAX_TOKENS_FP8),
    the W8A8 grouped GEMMs above: one engine build each."""
    import shared.engine.models.moe as moe

    batches = (2, 3, 4, 6)
    got = fp8_steps_by_setting(ctx, "fp8_moe_pairs", [
        (f"pairs to {limit}", (moe, "EXPERTS_DECODE_MAX_TOKENS_FP8", limit)) for limit in (2, 4)], batches,
        model="qwen3-30b-a3b", cuda_graph_max_bs=8, kv_cache_memory=4 << 30)
    for b in batches:
        ctx["report"].add("fp8_moe_pairs", f"B={b} to 2 / to 4", got[("pairs to 2", b)] / got[("pairs to 4", b)])


def fp8_kv_long(ctx):
    from shared.kv_transfer.pool_info import PoolInfo
    from .gpu_engine import decode_step_ms, release_memory
    from .suite_context import random_engine as _engine

    args, rep = ctx["args"], ctx["report"]
    context = 16384
    budget = 42 << 30  # 16 sequences of 16k in bf16 KV (Qwen3-8B: 144 KiB a token); 32 in FP8
    got = {}
    for tag, kv in (("bf16 kv", "auto"), ("fp8 kv", "fp8_e4m3")):
        eng = _engine(ctx, "qwen3-8b", quantization="fp8", kv_cache_dtype=kv, max_model_len=context + 64,
                      kv_cache_memory=budget, cuda_graph_max_bs=32, max_num_batched_tokens=16384)
        page_bytes = PoolInfo.from_tensor(eng.pool.buffer).page_bytes
        rep.add("fp8_kv_long", f"{tag} pages", eng.layout.num_pages,
                f"{eng.layout.num_pages * eng.layout.page_size} tokens in {budget / 2 ** 30:.0f} GiB")
        rep.add("fp8_kv_long", f"{tag} bytes/token", eng.layout.bytes_per_token,
                f"handoff page {page_bytes} bytes (what a NIXL write moves per page)")
        got[(tag, "bpt")] = eng.layout.bytes_per_token
        for b in ((16,) if kv == "auto" else (16, 32)):
            ms = decode_step_ms(eng, b, context, max(8, args.steps // 2), warm=4)
            got[(tag, b)] = ms
            rep.add("fp8_kv_long", f"{tag} B={b} ctx {context} step_ms", ms)
        eng.close()
        del eng
        release_memory()
    rep.add("fp8_kv_long", "B=16 step bf16kv/fp8kv", got[("bf16 kv", 16)] / got[("fp8 kv", 16)])
    rep.add("fp8_kv_long", "handoff bytes fp8/bf16", got[("fp8 kv", "bpt")] / got[("bf16 kv", "bpt")], "aim 0.5")


# (d) before (c): it is quick, and what matters most runs first when the budget is tight
FP8_SECTIONS = ("ceilings", "fp8_accuracy", "fp8_decode_8b", "fp8_gemm_cublas", "fp8_decode_8b_wide",
                "fp8_decode_route", "fp8_decode_prequant", "fp8_norm_quant", "fp8_decode_gemm_64",
                "fp8_pdl_past_one_row", "fp8_pdl_wait_first", "fp8_pdl_orders", "fp8_pdl_late_linear",
                "fp8_pdl_prefetch", "fp8_decode_profile", "fp8_decode_timeline",
                "fp8_attn_prefetch", "fp8_attn_prefetch_rows", "fp8_gemm",
                "fp8_moe_decode", "fp8_moe_timeline", "fp8_moe_pairs", "fp8_moe_pdl_rows", "fp8_kv_long",
                "fp8_prefill_profile")
SECTIONS = {"fp8_accuracy": fp8_accuracy, "fp8_decode_8b": fp8_decode_8b, "fp8_gemm": fp8_gemm,
            "fp8_gemm_cublas": fp8_gemm_cublas, "fp8_decode_8b_wide": fp8_decode_8b_wide,
            "fp8_decode_route": fp8_decode_route, "fp8_decode_prequant": fp8_decode_prequant,
            "fp8_norm_quant": fp8_norm_quant, "fp8_decode_gemm_64": fp8_decode_gemm_64,
            "fp8_decode_profile": fp8_decode_profile, "fp8_decode_timeline": fp8_decode_timeline,
            "fp8_moe_decode": fp8_moe_decode, "fp8_moe_timeline": fp8_moe_timeline,
            "fp8_moe_pairs": fp8_moe_pairs, "fp8_kv_long": fp8_kv_long,
            "fp8_prefill_profile": fp8_prefill_profile, **PDL_SECTIONS}
