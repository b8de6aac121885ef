"""The FP8 bench's sections on programmatic dependent launch (kernels/pdl.py): where each decode
kernel lets the next be scheduled, what it prefetches before its wait, and on how many rows;
`python -m loadtest.bench.fp8_device --sections ceilings,<name>` runs one (the section list with
the rest: fp8_sections.py)."""
from __future__ import annotations

from .fp8_steps import bench_engine, fp8_steps_by_setting, greedy_one_row, report_against


def fp8_pdl_past_one_row(ctx):
    """8B FP8 decode at B=1..32 with PDL on one-row launches, and on launches of up to 32 rows
    (kernels/pdl.py MAX_ROWS) with the linears and decode attention's first stage
    signalling the next kernel after their main loop from 2 to 16 rows (the default, Pdl.
    late_to_rows), never (all on entry), and from 2 to 32 rows: one engine build each, and 8 rows'
    greedy tokens, which must be equal (PDL changes no value)."""
    import functools

    import kernels.pdl as kp

    batches = (1, 4, 8, 16, 17, 24, 32)
    settings = [("one row", [(kp, "MAX_ROWS", {**kp.MAX_ROWS, ("fp8", "dense"): 1})])] + [
        (tag, [(kp, "MAX_ROWS", {**kp.MAX_ROWS, ("fp8", "dense"): 32}),
               (kp, "Pdl", functools.partial(kp.Pdl, late_to_rows=late))])
        for tag, late in (("32 rows, late to 16", 16), ("32 rows, on entry", 0), ("32 rows, late to 32", 32))]
    got = fp8_steps_by_setting(ctx, "fp8_pdl_past_one_row", settings, batches, greedy_rows=8)
    report_against(ctx["report"], "fp8_pdl_past_one_row", got, "one row", [t for t, _ in settings[1:]], batches)


def fp8_pdl_wait_first(ctx):
    """Decode with PDL's short kernels (norms, q/k-norm + RoPE, attention's second stage, the decode
    GEMM's x quantization: no main loop) waiting for the kernel before, then signalling the next (the
    default, kernels/pdl.py Pdl.wait_first_from_rows) against "before" (short kernels signalling on
    entry, x's quantization launched without PDL): 8B FP8 at B=1..32, 8B bf16 at B=1 (its PDL
    rows), 30B-A3B FP8 at B=1, 2, 8, 32; one engine build a setting, 8 rows' greedy tokens equal
    (FP8); the 8B FP8 default's B=32 time line by kernel."""
    import functools

    import kernels.pdl as kp
    import kernels.triton_fp8_decode_gemm as tg

    from .decode_timeline import decode_timeline

    args, rep = ctx["args"], ctx["report"]
    before = [(kp, "Pdl", functools.partial(kp.Pdl, wait_first_from_rows=1 << 30)), (tg, "QUANTIZE_PDL", False)]

    def time_line(eng, tag):
        if tag != "qwen3-8b fp8 wait first":
            return
        t = decode_timeline(eng, 32, args.ctx)
        rep.add("fp8_pdl_wait_first", "8B B=32 GPU span a step ms", t.step_ms,
                f"busy {t.busy_ms:.3f}, idle {t.idle_ms:.3f}; {t.kernels_per_step:.0f} kernels")
        for k in t.kernels[:9]:
            rep.add("fp8_pdl_wait_first", f"8B B=32 {k.name[:44]}", round(k.us_per_step, 1),
                    f"us a step in {k.launches_per_step:.0f} launches")

    for model, quant, batches, kw in (("qwen3-8b", "fp8", (1, 2, 8, 16, 24, 32), {}),
                                      ("qwen3-8b", "none", (1,), {}),
                                      ("qwen3-30b-a3b", "fp8", (1, 2, 8, 32), dict(kv_cache_memory=4 << 30))):
        name = f"{model} {'fp8' if quant == 'fp8' else 'bf16'}"
        got = fp8_steps_by_setting(
            ctx, "fp8_pdl_wait_first", [(f"{name} {t}", p, dict(quantization=quant))
                                        for t, p in (("before", before), ("wait first", None))],
            batches, model=model, greedy_rows=8 if quant == "fp8" else 0, after=time_line, **kw)
        report_against(rep, "fp8_pdl_wait_first", got, f"{name} before", [f"{name} wait first"], batches,
                       base_label="before", prefix=f"{name} ", tokens=quant == "fp8")


def fp8_pdl_orders(ctx):
    """8B decode, where each kernel lets the next be scheduled under PDL, against the default (short
    kernels waiting first; loop kernels on entry at one row, late from 2 to 16 rows): at one row,
    short kernels signalling on entry, and every kernel waiting first (FP8 and bf16); past 16 rows,
    the loop kernels signalling late to 32 (FP8). One engine build a setting; 8 rows' greedy tokens
    equal across the FP8 settings."""
    import functools

    import kernels.pdl as kp

    rep = ctx["report"]

    def pdl(**kw):
        return (kp, "Pdl", functools.partial(kp.Pdl, **kw))

    one_row = [("short on entry at 1 row", pdl(wait_first_from_rows=2)),
               ("all wait first at 1 row", pdl(late_from_rows=1))]
    for weights, quant, settings, batches in (
            ("fp8", "fp8", one_row + [("late to 32 rows", pdl(late_to_rows=32))], (1, 24, 32)),
            ("bf16", "none", one_row, (1,))):
        tags = [("default", None)] + settings
        got = fp8_steps_by_setting(ctx, "fp8_pdl_orders", [(f"{weights} {t}", p, dict(quantization=quant))
                                                            for t, p in tags], batches,
                                    greedy_rows=8 if weights == "fp8" else 0)
        for b in batches:
            for tag, _ in settings:
                if (b == 1) == ("1 row" in tag):
                    rep.add("fp8_pdl_orders", f"{weights} B={b} default/{tag}",
                            got[(f"{weights} default", b)] / got[(f"{weights} {tag}", b)])
        if weights == "fp8":
            same = all(got[(f"fp8 {t}", "tokens")] == got[("fp8 default", "tokens")] for t, _ in tags)
            rep.add("fp8_pdl_orders", "fp8 8 rows' greedy tokens equal", "yes" if same else "NO")


def fp8_pdl_late_linear(ctx):
    """8B decode at one row with one linear at a time (qkv_proj, o_proj, gate_up_proj, down_proj)
    signalling the next kernel after its main loop instead of on entry (gate/up is the one linear
    followed by another big kernel, down): FP8, and bf16 for gate/up; one engine build each."""
    import dataclasses

    import shared.engine.models.layers as layers

    rep = ctx["report"]
    enable = layers.enable_pdl

    def late_at(linear):
        def enable_pdl(model, pdl, prefetch_at=None):
            n = enable(model, pdl, prefetch_at)
            for name, m in model.named_modules():
                if name.endswith(linear) and getattr(m, "pdl", None) is not None:
                    m.pdl = dataclasses.replace(m.pdl, late_from_rows=1)
            return n
        return (layers, "enable_pdl", enable_pdl)

    for weights, quant, linears in (("fp8", "fp8", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
                                    ("bf16", "none", ("gate_up_proj",))):
        tags = [("default", None)] + [(f"{lin} late", late_at(lin)) for lin in linears]
        got = fp8_steps_by_setting(ctx, "fp8_pdl_late_linear", [(f"{weights} {t}", p, dict(quantization=quant))
                                                                 for t, p in tags], (1,))
        for tag, _ in tags[1:]:
            rep.add("fp8_pdl_late_linear", f"{weights} B=1 default/{tag}",
                    got[(f"{weights} default", 1)] / got[(f"{weights} {tag}", 1)])


def fp8_pdl_prefetch(ctx):
    """8B decode at B=1 (and 8 for FP8) with the linears prefetching 0, 1 (default), 2 or 4 of their
    first weight tiles into L2 before the PDL wait, FP8 and bf16 (deeper lost on both while the short
    kernels signalled on entry, kernels/NOTES.md; since they wait first, a linear's prefetch overlaps
    only the short kernel before it)."""
    rep = ctx["report"]
    for weights, quant, batches in (("fp8", "fp8", (1, 8)), ("bf16", "none", (1,))):
        got = fp8_steps_by_setting(ctx, "fp8_pdl_prefetch", [
            (f"{weights} prefetch {d}", None, dict(pdl_prefetch_k_blocks=d, quantization=quant))
            for d in (0, 1, 2, 4)], batches)
        for b in batches:
            for d in (0, 2, 4):
                rep.add("fp8_pdl_prefetch", f"{weights} B={b} prefetch 1 / {d}",
                        got[(f"{weights} prefetch 1", b)] / got[(f"{weights} prefetch {d}", b)])


def fp8_attn_prefetch(ctx):
    """8B decode at one row, FP8 and bf16, decode attention's split K/V prefetched into L2 while
    the kernel before runs (PDL) and not: the step, and stage 1's share of the time line."""
    from kernels import triton_decode_attention as tda

    from .decode_timeline import decode_timeline
    from .gpu_engine import decode_floor_ms, decode_step_ms
    from .suite_context import need_ceilings

    args, rep = ctx["args"], ctx["report"]
    c = need_ceilings(ctx)
    got = {}
    for tag, options in (("fp8", dict(quantization="fp8")), ("bf16", {})):
        for prefetch in (False, True):
            with bench_engine(ctx, (tda, "PDL_KV_PREFETCH", prefetch), max_model_len=2048, cuda_graph_max_bs=8,
                            kv_cache_memory=8 << 30, **options) as eng:
                floor, _ = decode_floor_ms(eng, 1, args.ctx, c.copy_gb_s)
                got[(tag, prefetch)] = ms = decode_step_ms(eng, 1, args.ctx, args.steps, overlap=True)
                stage1 = next((k.us_per_step for k in decode_timeline(eng, 1, args.ctx).kernels
                               if "decode_stage1" in k.name), float("nan"))
                got[(tag, prefetch, "tokens")] = greedy_one_row(eng, args.ctx)
                rep.add("fp8_attn_prefetch", f"{tag} B=1 prefetch {'on' if prefetch else 'off'} step_ms", ms,
                        f"x{ms / floor:.2f} of floor {floor:.3f}; "
                        f"attention stage 1 {stage1 / eng.model_config.num_layers:.1f} us a layer")
        rep.add("fp8_attn_prefetch", f"{tag} B=1 off/on", got[(tag, False)] / got[(tag, True)])
        same = got[(tag, False, "tokens")] == got[(tag, True, "tokens")]
        rep.add("fp8_attn_prefetch", f"{tag} greedy tokens off == on", "yes" if same else "NO",
                "64 tokens of one row in CUDA graphs: a prefetch is only a hint")
    rep.add("fp8_attn_prefetch", "bf16/fp8 B=1 (prefetch on)", got[("bf16", True)] / got[("fp8", True)], "aim >= 1.6")


def fp8_attn_prefetch_rows(ctx):
    """8B FP8 decode at B=1..32 with decode attention's K/V prefetch under PDL on launches of up to 1
    row, 2 (default, kernels/triton_decode_attention.py PDL_KV_PREFETCH_MAX_ROWS), 8 and 32: it was held
    to one row while the kernel before attention's first stage signalled on entry (32 rows' K/V asked
    for while the big kernel two back still streamed); that kernel (q/k-norm + RoPE) now waits first.
    One engine build each; 8 rows' greedy tokens equal."""
    from kernels import triton_decode_attention as tda

    rep = ctx["report"]
    batches = (1, 2, 4, 8, 16, 32)
    settings = [(f"to {r} rows", (tda, "PDL_KV_PREFETCH_MAX_ROWS", r)) for r in (1, 2, 8, 32)]
    got = fp8_steps_by_setting(ctx, "fp8_attn_prefetch_rows", settings, batches, greedy_rows=8)
    report_against(rep, "fp8_attn_prefetch_rows", got, "to 1 rows", [t for t, _ in settings[1:]], batches,
                   base_label="to 1 row")


def fp8_moe_pdl_rows(ctx):
    """30B-A3B decode at B=1, 2, 8, 16, 32, FP8 and bf16, with PDL on one-row launches and on
    launches of up to 32 rows (kernels/pdl.py MAX_ROWS; the loop kernels signalling late from 2 to
    16 rows, as dense models run): one engine build each; 8 rows' greedy tokens must be equal."""
    import kernels.pdl as kp

    batches = (1, 2, 8, 16, 32)
    rep = ctx["report"]
    for weights, quant in (("fp8", "fp8"), ("16-bit", "none")):
        got = fp8_steps_by_setting(ctx, "fp8_moe_pdl_rows", [
            (f"{weights} PDL to {rows} row{'s' if rows > 1 else ''}",
             (kp, "MAX_ROWS", {**kp.MAX_ROWS, (weights, "moe"): rows})) for rows in (1, 32)],
            batches, model="qwen3-30b-a3b", cuda_graph_max_bs=32, kv_cache_memory=4 << 30, greedy_rows=8,
            quantization=quant)
        one, many = f"{weights} PDL to 1 row", f"{weights} PDL to 32 rows"
        for b in batches:
            rep.add("fp8_moe_pdl_rows", f"{weights} B={b} 1 row / 32 rows", got[(one, b)] / got[(many, b)])
        rep.add("fp8_moe_pdl_rows", f"{weights} 8 rows' greedy tokens equal",
                "yes" if got[(one, "tokens")] == got[(many, "tokens")] else "NO")


PDL_SECTIONS = {"fp8_pdl_past_one_row": fp8_pdl_past_one_row, "fp8_pdl_wait_first": fp8_pdl_wait_first,
                "fp8_pdl_orders": fp8_pdl_orders, "fp8_pdl_late_linear": fp8_pdl_late_linear,
                "fp8_pdl_prefetch": fp8_pdl_prefetch, "fp8_attn_prefetch": fp8_attn_prefetch,
                "fp8_attn_prefetch_rows": fp8_attn_prefetch_rows, "fp8_moe_pdl_rows": fp8_moe_pdl_rows}
