"""The FP8 bench sections' shared loop (fp8_sections.py, fp8_pdl_sections.py): a random-weight
engine built under module-global patches, decode steps timed per setting and batch, and greedy
tokens to check that a setting changes no value."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def bench_engine(ctx, patch: tuple | None = None, model: str = "qwen3-8b", **engine_kw):
    """A random-weight engine of `model` (engine_kw: its options), closed and its memory released
    on every exit; patch (module, name, value), or a list of them: that module global set while
    the engine is built and runs (it is read when the decode graphs are captured and at every
    eager call), then restored."""
    from .gpu_engine import release_memory
    from .suite_context import random_engine

    patches = [] if patch is None else list(patch) if isinstance(patch, list) else [patch]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    eng = None
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        eng = random_engine(ctx, model, **engine_kw)
        yield eng
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
        if eng is not None:
            eng.close()
        del eng
        release_memory()


def fp8_steps_by_setting(ctx, section: str, settings, batches, model: str = "qwen3-8b", greedy_rows: int = 0,
                          after=None, **engine_kw) -> dict:
    """FP8 decode steps (ms) of `model` at each batch, one engine build per setting (tag, patch) or
    (tag, patch, engine options): patch as bench_engine's. Each step is the better of two runs and
    goes into the report with its floor; returns {(tag, batch): ms}, and {(tag, "tokens"): ...}
    with greedy_rows: that many rows' greedy tokens decoded together (greedy_rows). after(eng,
    tag): more measurements on each setting's engine, after its steps."""
    from .gpu_engine import decode_floor_ms, decode_step_ms
    from .suite_context import need_ceilings

    args, rep = ctx["args"], ctx["report"]
    c = need_ceilings(ctx)
    got = {}
    opts = dict(quantization="fp8", max_model_len=2048, cuda_graph_max_bs=max(batches), kv_cache_memory=8 << 30)
    for tag, patch, *own in settings:
        with bench_engine(ctx, patch, model, **{**opts, **engine_kw, **(own[0] if own else {})}) as eng:
            for b in batches:
                floor, _ = decode_floor_ms(eng, b, args.ctx, c.copy_gb_s)
                runs = [decode_step_ms(eng, b, args.ctx, args.steps, overlap=True) for _ in range(2)]
                got[(tag, b)] = ms = min(runs)
                rep.add(section, f"{tag} B={b} step_ms", ms,
                        f"x{ms / floor:.2f} of floor {floor:.3f}; runs {runs[0]:.3f} / {runs[1]:.3f}")
            if after is not None:
                after(eng, tag)
            if greedy_rows:
                got[(tag, "tokens")] = greedy_rows(eng, args.ctx, greedy_rows)
    return got


def report_against(rep, section: str, got: dict, base: str, tags, batches, base_label: str | None = None,
                   prefix: str = "", tokens: bool = True) -> None:
    """Into the report: each batch's step under `base` over the step under each of `tags` ("B=8
    base/tag", after `prefix`), and with tokens, whether every setting's greedy tokens equal the
    base's (fp8_steps_by_setting's greedy_rows)."""
    label = base_label or base
    for b in batches:
        for tag in tags:
            rep.add(section, f"{prefix}B={b} {label}/{tag.removeprefix(prefix)}", got[(base, b)] / got[(tag, b)])
    if tokens:
        same = all(got[(t, "tokens")] == got[(base, "tokens")] for t in tags)
        rep.add(section, f"{prefix}8 rows' greedy tokens equal", "yes" if same else "NO")


def greedy_one_row(eng, ctx_len: int) -> list[int]:
    """64 greedy tokens of one random prompt (the decode steps run in the one-row graph)."""
    return greedy_rows(eng, ctx_len, 1)[0]


def greedy_rows(eng, ctx_len: int, rows: int) -> list[list[int]]:
    """64 greedy tokens of each of `rows` random prompts decoded together (the decode steps run
    in the graph of that many rows)."""
    import numpy as np

    from shared.engine import SamplingParams

    from .gpu_engine import random_prompts

    prompts = random_prompts(np.random.default_rng(7), eng.model_config.vocab_size, [ctx_len] * rows)
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)) for p in prompts]
    tokens: dict = {rid: [] for rid in rids}
    while eng.has_work:
        for out in eng.step():
            if out.rid in tokens:
                tokens[out.rid] += out.token_ids
    return [tokens[rid] for rid in rids]
