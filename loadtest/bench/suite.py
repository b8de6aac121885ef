"""`duet bench`: the engine's GPU benchmark suite, on random-weight models of real shapes.

    duet bench [--models qwen3-0.6b,qwen3-8b] [--sections ...] [--json out.json]
    duet bench --suite tp            # on a 2-GPU host: TP=2 equality, fused all-reduce, TP decode, MoE TP/EP, FP8 under TP
    duet bench --suite fp8 --budget-s 400   # FP8: accuracy, decode, GEMM, MoE, long-context KV (fp8_sections.py)

Sections (single-GPU suite, in order): ceilings (copy bandwidth, bf16 matmul), equality
(greedy tokens vs transformers, Qwen3 and Llama), decode (step time at batch 1/8/32/128,
context 1k, against the bytes/bandwidth floor; graphs and overlap on/off), prefill
(1/4/16 prompts of 2k tokens, tokens/s and TFLOP/s against the matmul peak), offline
(256 random requests, 100-1024 tokens in and out, Qwen3-0.6B shape, overlap off/on, vs
transformers generate in sub-batches), hf (transformers decode ms/step: static cache +
torch.compile reduce-overhead, and eager). FP8 twins (not in the default list):
decode_fp8, prefill_fp8, offline_fp8 (FP8 weights, and FP8 KV; floors in FP8 bytes, the
prefill ceiling the FP8 matmul peak). Every number is printed as it is measured and
a table comes last. --budget-s skips sections once the time is spent, and a watchdog prints
the table and exits if a section hangs past it. GPU_NOTES.md records results and the
commands that made them."""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .suite_context import Report
from .suite_context import measure_ceilings as _ceilings
from .suite_context import need_ceilings as _need_ceilings
from .suite_context import random_engine as _engine

SINGLE_SECTIONS = ("ceilings", "equality", "decode", "prefill", "offline", "hf")
TP_SECTIONS = ("ceilings", "tp_equality", "allreduce", "tp_decode", "moe_tp", "tp_fp8", "tp_fp8_steps")


def _parse(argv):
    p = argparse.ArgumentParser(prog="duet bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=("single", "tp", "fp8"), default="single")
    p.add_argument("--sections", default=None, help="comma list (default: all of the suite)")
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b", help="shapes for decode/prefill/hf")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per point")
    p.add_argument("--offline-requests", type=int, default=256)
    p.add_argument("--hf-sub-batch", type=int, default=64)
    p.add_argument("--hf-max-sub-batches", type=int, default=1,
                   help="transformers offline: sub-batches actually run (0 = all); its rate is per token")
    p.add_argument("--hf-compile-models", default="qwen3-0.6b",
                   help="models whose compiled transformers peer is timed (compiles take minutes)")
    p.add_argument("--hf-compile-timeout", type=float, default=240.0, help="seconds for one compiled peer")
    p.add_argument("--tp-batches", default="1,32")
    p.add_argument("--moe-tp-batches", default="1,64")
    p.add_argument("--tp-equality-dtypes", default="float32,bfloat16")
    p.add_argument("--moe-tp-layouts", default="2/1,2/2", help="tp/ep pairs for the moe_tp section")
    p.add_argument("--json", default=None)
    p.add_argument("--workdir", default=None)
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole run: later sections are skipped, a hung one cut off")
    return p.parse_args(argv)


def _suite_sections(suite: str) -> tuple[str, ...]:
    if suite == "fp8":
        from .fp8_sections import FP8_SECTIONS
        return FP8_SECTIONS
    return SINGLE_SECTIONS if suite == "single" else TP_SECTIONS


def _watchdog(deadline: float, report: "Report", args) -> None:
    """Past the deadline (plus a grace for the section in flight): print what was measured and
    leave, so a hung kernel cannot swallow the run's results."""
    import threading

    def fire():
        print(f"\n=== duet bench: budget of {args.budget_s:.0f}s spent, stopping ===\n" + report.table(), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report.data, indent=1, default=str))
        os._exit(3)

    t = threading.Timer(max(1.0, deadline - time.monotonic()), fire)
    t.daemon = True
    t.start()


def main(argv=None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    if not torch.cuda.is_available():
        print("duet bench: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    start = time.monotonic()
    sections = args.sections.split(",") if args.sections else list(_suite_sections(args.suite))
    root = Path(args.workdir or tempfile.mkdtemp(prefix="duet-bench-"))
    report = Report()
    if args.budget_s:
        _watchdog(start + args.budget_s + 20, report, args)
    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    report.add("env", "device", f"{props.name} x{torch.cuda.device_count()}, {props.total_memory / 2**30:.0f} GiB")
    import transformers
    import triton
    report.add("env", "versions", f"torch {torch.__version__}, triton {triton.__version__}, "
                                  f"transformers {transformers.__version__}")
    ctx = dict(args=args, root=root, report=report, dev=dev, ceilings=None)
    for name in sections:
        t0 = time.monotonic()
        if args.budget_s and t0 - start > args.budget_s - 15:
            report.add(name, "skipped", f"budget: {t0 - start:.0f} of {args.budget_s:.0f}s spent")
            continue
        try:
            SECTION_FUNCS[name](ctx)
        except Exception as e:  # noqa: BLE001 - one failing section must not hide the others
            traceback.print_exc()
            report.add(name, "FAILED", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        report.add(name, "section_sec", round(time.monotonic() - t0, 1))
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(report.data, indent=1, default=str))
    print("\n=== duet bench ===\n" + report.table(), flush=True)
    return 0


# -- sections ---------------------------------------------------------------------------
def _equality(ctx):
    from .hf_peer import equality_prompts, greedy_equality
    from .shapes import random_checkpoint_dir

    for name in ("qwen3-small", "llama-small"):
        ckpt = random_checkpoint_dir(name, ctx["root"], ctx["dev"])
        res = greedy_equality(ckpt, ctx["dev"], equality_prompts(4096), new_tokens=48)
        for k, v in res.items():
            ctx["report"].add("equality", f"{name} {k}", v)


def _models(ctx):
    return [m for m in ctx["args"].models.split(",") if m]


# FP8 twins of decode, prefill and offline: FP8 weights (--quantization fp8 on the random
# weights), and for decode FP8 KV as well; floors in FP8 bytes, the prefill ceiling the FP8
# matmul peak (torch._scaled_mm, measured in the same run)
FP8_WEIGHTS = dict(quantization="fp8")
FP8_KV = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")


def _decode(ctx, section="decode", variants=(("", {}),)):
    from .gpu_engine import decode_floor_ms, decode_step_ms, release_memory

    args, rep = ctx["args"], ctx["report"]
    c = _need_ceilings(ctx)
    batches = [int(b) for b in args.batches.split(",")]
    for name in _models(ctx):
        for tag, options in variants:
            label = f"{name}{tag}"
            t0 = time.monotonic()
            eng = _engine(ctx, name, max_model_len=4096, cuda_graph_max_bs=max(batches), **options)
            rep.add(section, f"{label} engine_start_sec", round(time.monotonic() - t0, 1),
                    f"weights {eng.weight_bytes / 2**30:.2f} GiB ({eng.weights_description}), KV {eng.layout.num_pages} "
                    f"pages of {str(eng.kv_dtype).removeprefix('torch.')}")
            for b in batches:
                floor, gb = decode_floor_ms(eng, b, args.ctx, c.copy_gb_s)
                ms = decode_step_ms(eng, b, args.ctx, args.steps)
                rep.add(section, f"{label} B={b} step_ms", ms, f"floor {floor:.3f} ms ({gb:.2f} GB), x{ms / floor:.2f}")
                ms_ov = decode_step_ms(eng, b, args.ctx, args.steps, overlap=True)
                rep.add(section, f"{label} B={b} step_ms overlap", ms_ov, f"x{ms_ov / floor:.2f} of floor")
                if b in (1, 32) and section == "decode":
                    ms_off = decode_step_ms(eng, b, args.ctx, args.steps, graphs=False)
                    rep.add(section, f"{label} B={b} step_ms graphs_off", ms_off, f"graphs on {ms:.3f}")
            ctx.setdefault(f"{section}_ms", {})[label] = {b: rep.data[section][f"{label} B={b} step_ms"]
                                                           for b in batches}
            eng.close()
            del eng
            release_memory()


def _decode_fp8(ctx):
    _decode(ctx, "decode_fp8", ((" fp8", FP8_WEIGHTS), (" fp8+fp8kv", FP8_KV)))


def _prefill(ctx, section="prefill", options=None):
    from .gpu_engine import prefill_rate, release_memory

    c = _need_ceilings(ctx)
    fp8 = bool(options)
    peak = c.fp8_matmul_tflops if fp8 and c.fp8_matmul_tflops else c.matmul_tflops
    for name in _models(ctx):
        eng = _engine(ctx, name, max_num_batched_tokens=16384, max_model_len=4096, **(options or {}))
        prefill_rate(eng, 1, 2048, seed=99)  # warm-up: Triton compiles the extend kernel
        for n in (1, 4, 16):
            r = prefill_rate(eng, n, 2048, seed=n)
            ctx["report"].add(section, f"{name} {n}x2048 tok_s", r["tok_s"],
                              f"{r['tflops']:.0f} TFLOP/s = {100 * r['tflops'] / peak:.0f}% of "
                              f"{'FP8 (_scaled_mm)' if fp8 else 'bf16'} matmul peak")
        eng.close()
        del eng
        release_memory()


def _prefill_fp8(ctx):
    _prefill(ctx, "prefill_fp8", FP8_WEIGHTS)


def _offline_fp8(ctx):
    """The offline run (Qwen3-0.6B shape, overlap on) with FP8 weights and FP8 KV beside bf16."""
    from .gpu_engine import offline_run, offline_workload, release_memory
    from .shapes import hf_config

    args, rep = ctx["args"], ctx["report"]
    name = "qwen3-0.6b"
    vocab = hf_config(name).vocab_size
    prompts, outs = offline_workload(args.offline_requests, vocab)
    for tag, options in (("bf16", {}), ("fp8", FP8_WEIGHTS), ("fp8+fp8kv", FP8_KV)):
        eng = _engine(ctx, name, overlap_schedule=True, max_model_len=4096, **options)
        warm_p, _ = offline_workload(8, vocab, seed=1)
        offline_run(eng, warm_p, [16] * 8)
        r = offline_run(eng, prompts, outs)
        rep.add("offline_fp8", f"{name} {tag} out_tok_s", r["out_tok_s"],
                f"{r['requests']} req in {r['sec']:.1f}s, total {r['total_tok_s']:.0f} tok/s, "
                f"KV {eng.layout.num_pages} pages")
        eng.close()
        del eng
        release_memory()


def _offline(ctx):
    from .gpu_engine import offline_run, offline_workload, release_memory
    from .hf_peer import hf_model, hf_offline
    from .shapes import hf_config

    args, rep = ctx["args"], ctx["report"]
    name = "qwen3-0.6b"
    vocab = hf_config(name).vocab_size
    prompts, outs = offline_workload(args.offline_requests, vocab)
    runs = {}
    for overlap in (False, True):
        eng = _engine(ctx, name, overlap_schedule=overlap, max_model_len=4096)
        warm_p, warm_o = offline_workload(8, vocab, seed=1)
        offline_run(eng, warm_p, [16] * 8)
        r = offline_run(eng, prompts, outs)
        runs[overlap] = r
        rep.add("offline", f"{name} overlap={'on' if overlap else 'off'} out_tok_s", r["out_tok_s"],
                f"{r['requests']} req in {r['sec']:.1f}s, total {r['total_tok_s']:.0f} tok/s")
        eng.close()
        del eng
        release_memory()
    same = sum(a == b for a, b in zip(runs[False]["tokens"], runs[True]["tokens"]))
    rep.add("offline", "overlap on/off identical sequences", f"{same}/{len(prompts)}")
    # graphs off on the first 32 requests: same tokens as graphs on (same shapes by design)
    eng = _engine(ctx, name, cuda_graph=False, max_model_len=4096, cuda_graph_max_bs=32)
    r_off = offline_run(eng, prompts[:32], outs[:32])
    eng.close()
    del eng
    release_memory()
    eng = _engine(ctx, name, max_model_len=4096, cuda_graph_max_bs=32)
    r_on = offline_run(eng, prompts[:32], outs[:32])
    eng.close()
    del eng
    release_memory()
    same = sum(a == b for a, b in zip(r_off["tokens"], r_on["tokens"]))
    rep.add("offline", "graphs on/off identical sequences (32 req)", f"{same}/32")
    model = hf_model(name, ctx["dev"])
    hf = hf_offline(model, prompts, outs, args.hf_sub_batch, args.hf_max_sub_batches or None)
    del model
    release_memory()
    best = max(runs[False]["out_tok_s"], runs[True]["out_tok_s"])
    rep.add("offline", "transformers generate out_tok_s", hf["out_tok_s"],
            f"{hf['requests']} req in sub-batches of {hf['sub_batch']}, {hf['sec']:.1f}s")
    rep.add("offline", "ratio ours/transformers", best / hf["out_tok_s"])


def _hf(ctx):
    from .gpu_engine import release_memory
    from .hf_peer import experts_impl, hf_decode_ms, hf_model
    from .tp import in_fresh_process

    args, rep = ctx["args"], ctx["report"]
    compiled = set(args.hf_compile_models.split(","))
    for name in _models(ctx):
        model = hf_model(name, ctx["dev"])
        ours = ctx.get("decode_ms", {}).get(name, {})
        impl = experts_impl(model) if "moe" in type(model).__name__.lower() else ""
        for b in (1, 32):
            ms = hf_decode_ms(model, b, args.ctx)
            note = f"ours {ours[b]:.3f} ms, x{ms / ours[b]:.1f}" if b in ours else ""
            rep.add("hf", f"{name} B={b} eager generate ms/step", ms,
                    note + (f", experts {impl}" if impl else ""))
        del model
        release_memory()
        if name in compiled:  # compiles can take minutes or fail: its own process, bounded
            try:
                ms = in_fresh_process("loadtest.bench.hf_peer:compiled_decode_ms", name, str(ctx["dev"]), args.ctx,
                                      timeout=args.hf_compile_timeout)
                rep.add("hf", f"{name} B=1 static+compile ms/step", ms,
                        f"ours {ours[1]:.3f} ms, x{ms / ours[1]:.2f}" if 1 in ours else "")
            except Exception as e:  # noqa: BLE001 - "compiled, if it compiles"
                rep.add("hf", f"{name} B=1 static+compile", "did not finish",
                        f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''}")


def _tp_equality(ctx):
    from .hf_peer import equality_prompts
    from .shapes import random_checkpoint_dir
    from .tp import in_fresh_process

    prompts = equality_prompts(4096, n=6)
    for name, layouts in (("qwen3-small", [(2, 1)]), ("qwen3-moe-small", [(2, 1), (2, 2)])):
        ckpt = str(random_checkpoint_dir(name, ctx["root"], ctx["dev"]))
        for dtype in ctx["args"].tp_equality_dtypes.split(","):
            if name == "qwen3-small" and dtype != "float32":
                continue  # the dense bf16 comparison is the MoE one's twin; fp32 is the exact check
            ref = in_fresh_process("loadtest.bench.tp:greedy_tokens", ckpt, dtype, 1, prompts, 48)
            for tp, ep in layouts:
                got = in_fresh_process("loadtest.bench.tp:greedy_tokens", ckpt, dtype, tp, prompts, 48, ep)
                # tokens equal up to each sequence's first divergence (after it the contexts differ)
                ctx["report"].add("tp_equality", f"{name} {dtype} TP{tp}/EP{ep}==TP1 sequences",
                                  *_equal_share(ref, got))


def _allreduce(ctx):
    from .tp import AR_MODES, fused_all_reduce_bench

    for r in fused_all_reduce_bench():
        for mode in AR_MODES:
            ctx["report"].add("allreduce", f"T={r['tokens']} ({r['bytes'] // 1024} KiB) {mode}_us", r[f"{mode}_us"],
                              f"NCCL+add_norm {r['nccl_us']:.1f} us, x{r['nccl_us'] / r[f'{mode}_us']:.2f}, "
                              f"max|diff| {r[f'{mode}_diff']:.3g}, failed waits {r['failed_waits']}")


def _tp_decode(ctx):
    from .shapes import config_only_dir
    from .tp import in_fresh_process

    args, rep = ctx["args"], ctx["report"]
    c = _need_ceilings(ctx)
    name = "qwen3-8b"
    model_dir = str(config_only_dir(name, ctx["root"]))
    batches = [int(b) for b in args.tp_batches.split(",")]
    for tp, car in ((1, False), (2, False), (2, True)):
        rows = in_fresh_process("loadtest.bench.tp:tp_decode_rows", model_dir, tp, car, batches, args.ctx,
                                args.steps, c.copy_gb_s)
        for r in rows:
            rep.add("tp_decode", f"{name} TP={tp} custom_ar={'on' if r['custom_ar'] else 'off'} B={r['batch']} "
                                 f"step_ms", r["step_ms"], f"per-rank floor {r['floor_ms']:.3f} ms")


def _equal_share(ref, got) -> tuple[str, str]:
    """("same/total" sequences, share of tokens before each sequence's first divergence)."""
    same = sum(a == b for a, b in zip(ref, got))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                 for a, b in zip(ref, got)) / sum(map(len, ref))
    return f"{same}/{len(ref)}", f"{100 * prefix:.1f}% of tokens before the first divergence"


def _tp_fp8(ctx):
    """FP8 under TP=2 (two GPUs): greedy tokens with FP8 weights (quantized at load), and with FP8
    weights + FP8 KV, at TP=2 (the MoE model also EP=2) against TP=1, bf16 compute, random small
    models (the step times: tp_fp8_steps)."""
    from .hf_peer import equality_prompts
    from .shapes import random_checkpoint_dir
    from .tp import in_fresh_process

    rep = ctx["report"]
    prompts = equality_prompts(4096, n=6)
    for name, layouts in (("qwen3-small", [(2, 1)]), ("qwen3-moe-small", [(2, 1), (2, 2)])):
        ckpt = str(random_checkpoint_dir(name, ctx["root"], ctx["dev"]))
        for label, kv in (("fp8", "auto"), ("fp8+fp8kv", "fp8_e4m3")):
            ref = in_fresh_process("loadtest.bench.tp:greedy_tokens", ckpt, "bfloat16", 1, prompts, 48, 1, "fp8", kv)
            for tp, ep in layouts:
                got = in_fresh_process("loadtest.bench.tp:greedy_tokens", ckpt, "bfloat16", tp, prompts, 48, ep,
                                       "fp8", kv)
                rep.add("tp_fp8", f"{name} {label} TP{tp}/EP{ep}==TP1 sequences", *_equal_share(ref, got))


def _tp_fp8_steps(ctx):
    """Qwen3-8B's FP8 decode step at TP=1 and TP=2 (fused all-reduce, overlap)."""
    from .shapes import config_only_dir
    from .tp import in_fresh_process

    args, rep = ctx["args"], ctx["report"]
    c = _need_ceilings(ctx)
    model_dir = str(config_only_dir("qwen3-8b", ctx["root"]))
    batches = [int(b) for b in args.tp_batches.split(",")]
    steps = {}
    for tp, car in ((1, False), (2, True)):
        for r in in_fresh_process("loadtest.bench.tp:tp_decode_rows", model_dir, tp, car, batches, args.ctx,
                                  args.steps, c.copy_gb_s, 1, (True,), "fp8"):
            steps[(tp, r["batch"])] = r["step_ms"]
            rep.add("tp_fp8", f"qwen3-8b fp8 TP={tp} B={r['batch']} step_ms", r["step_ms"],
                    f"per-rank floor {r['floor_ms']:.3f} ms, x{r['step_ms'] / r['floor_ms']:.2f}")
    for b in batches:
        if (1, b) in steps and (2, b) in steps:
            rep.add("tp_fp8", f"qwen3-8b fp8 B={b} TP2/TP1", steps[(2, b)] / steps[(1, b)], "aim 0.6 (bf16: 0.74-0.76)")


def _moe_tp(ctx):
    """Qwen3-30B-A3B shape: decode step with experts sliced over 2 ranks (TP) and split whole
    (EP), beside TP=1 on one GPU of the same host (random weights, graphs and overlap on)."""
    from .shapes import config_only_dir
    from .tp import in_fresh_process

    args, rep = ctx["args"], ctx["report"]
    c = _need_ceilings(ctx)
    name = "qwen3-30b-a3b"
    model_dir = str(config_only_dir(name, ctx["root"]))
    batches = [int(b) for b in args.moe_tp_batches.split(",")]
    layouts = [tuple(int(x) for x in t.split("/")) for t in args.moe_tp_layouts.split(",")]
    for tp, ep in layouts:
        try:
            rows = in_fresh_process("loadtest.bench.tp:tp_decode_rows", model_dir, tp, True, batches, args.ctx,
                                    args.steps, c.copy_gb_s, ep, (True,), timeout=420)
        except Exception as e:  # noqa: BLE001 - report and go on
            rep.add("moe_tp", f"{name} TP={tp} EP={ep}", "FAILED", str(e).strip().splitlines()[-1][:160])
            continue
        for r in rows:
            rep.add("moe_tp", f"{name} TP={tp} EP={ep} B={r['batch']} step_ms", r["step_ms"],
                    f"per-rank floor {r['floor_ms']:.3f} ms, x{r['step_ms'] / r['floor_ms']:.2f}")


def _spec(ctx):
    """Speculative decoding (not in the default list: `duet bench --sections spec`): the
    bounded run of spec_device.py, its rows in this report (mean accepted length, acceptance
    by draft position, verify vs decode step, accept-all bounds)."""
    from .spec_device import main as spec_main

    spec_main(["--budget-s", "330", "--json", str(ctx["root"] / "spec.json")])
    data = json.loads((ctx["root"] / "spec.json").read_text())
    for section, rows in data.items():
        for what, value in rows.items():
            ctx["report"].add("spec", f"{section} {what}", value)


SECTION_FUNCS = {"ceilings": _ceilings, "equality": _equality, "decode": _decode, "prefill": _prefill,
                 "offline": _offline, "hf": _hf, "tp_equality": _tp_equality, "allreduce": _allreduce,
                 "tp_decode": _tp_decode, "moe_tp": _moe_tp, "tp_fp8": _tp_fp8, "tp_fp8_steps": _tp_fp8_steps,
                 "decode_fp8": _decode_fp8, "prefill_fp8": _prefill_fp8, "offline_fp8": _offline_fp8, "spec": _spec}


def _fp8_section(name):
    def run(ctx):
        from .fp8_sections import SECTIONS
        SECTIONS[name](ctx)
    return run


for _name in ("fp8_accuracy", "fp8_decode_8b", "fp8_gemm", "fp8_gemm_cublas", "fp8_decode_8b_wide",
              "fp8_decode_route", "fp8_decode_prequant", "fp8_norm_quant", "fp8_decode_gemm_64",
              "fp8_pdl_past_one_row", "fp8_pdl_wait_first", "fp8_pdl_orders", "fp8_pdl_late_linear", "fp8_pdl_prefetch", "fp8_decode_profile",
              "fp8_decode_timeline",
              "fp8_attn_prefetch", "fp8_attn_prefetch_rows", "fp8_moe_decode",
              "fp8_moe_timeline", "fp8_moe_pairs", "fp8_moe_pdl_rows", "fp8_kv_long", "fp8_prefill_profile"):
    SECTION_FUNCS[_name] = _fp8_section(_name)


if __name__ == "__main__":
    sys.exit(main())
