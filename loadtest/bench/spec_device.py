"""Speculative decoding on one GPU, bounded: Qwen3-8B shape, random weights.

    PYTHONPATH=. python -m loadtest.bench.spec_device [--budget-s 330] [--json spec.json]
    TRITON_INTERPRET=1 PYTHONPATH=. python -m loadtest.bench.spec_device --smoke   # CPU: the script runs

Sections (each in try/except; each skipped when the time budget is spent):
  kernels  verify attention and the rejection-sampling kernel against their torch references
           at the real shapes
  steps    one loaded target: the forward of a verify step of K + 1 tokens a sequence
           (K = 1..7, batch 1/8/32, plus 64/128 for K = 2, 4) against a decode step, both
           through their CUDA graphs with the LM head; from them the expected speed-up at
           acceptance 0.6 and 0.8 and the batch above which speculation stops paying (the
           default for stepping aside, shared/engine/speculative/policy.py)
  bound    tokens/s of one request at batch 1 with the benchmark-only accept-all switch
           (every draft token stands: the method's ceiling) against no speculation: n-gram
           K=4, a Qwen3-0.6B-shape draft model K=4, an EAGLE-3 head K=4 (its passes run as
           captured graphs; their cost per step is reported); mean accepted length
  equality greedy tokens with real verification (n-gram and the draft model) against the plain
           engine on the same target

A short table comes last. The figures are engine steps (schedule, draft, forward, verify,
append) unless a row says forward."""
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

K_SWEEP = (1, 2, 3, 4, 5, 6, 7)
BATCHES = (1, 8, 32)
WIDE_BATCHES = (64, 128)  # K = 2 and 4 only: where the crossover is
WIDE_K = (2, 4)
ACCEPTANCE = (0.6, 0.8)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    @property
    def left(self) -> float:
        return self.end - time.monotonic()


# -- shapes --------------------------------------------------------------------------------------
def eagle_head_dir(root: Path, target_cfg, draft_vocab: int) -> Path:
    """An EAGLE-3 head config for the target (the public format; weights drawn at load)."""
    d = root / "eagle3-head"
    d.mkdir(parents=True, exist_ok=True)
    h = target_cfg.hidden_size
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": target_cfg.intermediate_size, "num_attention_heads": target_cfg.num_attention_heads,
           "num_key_value_heads": target_cfg.num_key_value_heads, "head_dim": target_cfg.head_dim,
           "num_hidden_layers": 1, "vocab_size": target_cfg.vocab_size, "draft_vocab_size": draft_vocab,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
           "tie_word_embeddings": False, "target_hidden_size": h}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify step appends when each draft token stands with probability alpha
    (given the ones before it did): accepted drafts + the target's own token."""
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


# -- sections ------------------------------------------------------------------------------------
def section_kernels(ctx) -> None:
    import torch

    from kernels.rejection_sample import rejection_sample
    from kernels.rejection_sample import rejection_sample_reference
    from kernels.verify_attention import verify_attention, verify_attention_reference
    from loadtest.bench.accuracy import relative_error
    from loadtest.bench.random_paged_kv import random_paged_kv
    from shared.engine.speculative.rejection import uniform

    rep, dev, smoke = ctx["report"], ctx["dev"], ctx["smoke"]
    dtype = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    hq, hkv, hd = (8, 2, 64) if smoke else (32, 8, 128)
    for lens, q in (([40, 9], 3), ([1040], 5), ([1040] * 8, 5), ([300, 4000, 17], 8)) if not smoke else (([40, 9], 3),):
        kv = random_paged_kv(lens, hkv, hd, 16, dtype, dev, g)
        qt = torch.randn(len(lens) * q, hq, hd, generator=g).to(dev, dtype)
        out = verify_attention(qt, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, hd ** -0.5, q)
        ref = verify_attention_reference(qt, kv.k_cache, kv.v_cache, kv.page_table, kv.seq_lens, hd ** -0.5, q)
        rep.add("kernels", f"verify_attention B={len(lens)} q={q} rel_err", relative_error(out, ref))
    B, K, V = (3, 2, 300) if smoke else (8, 4, 151936)
    tl = (torch.randn(B, K + 1, V, generator=g) * 3).log_softmax(-1)
    q = (tl[:, :K] + torch.randn(B, K, V, generator=g)).softmax(-1)
    dt = q.reshape(-1, V).multinomial(1, generator=g).reshape(B, K)
    n = torch.full((B,), K)
    u = uniform(torch.randint(0, 2**32, (B, K), generator=g))
    keys = torch.randint(0, 2**32, (B, K + 1), generator=g)
    args = [t.to(dev) for t in (tl, q, dt, n, u, keys)]
    a, f = rejection_sample(*args)
    ra, rf = rejection_sample_reference(*[t.cpu() for t in args])
    rep.add("kernels", "rejection_sample == reference", a.cpu().tolist() == ra.tolist() and f.cpu().tolist() == rf.tolist())
    rep.add("kernels", f"rejection_sample B={B} K={K} V={V} ms", _median_ms(lambda: rejection_sample(*args), 5))


def _fake_requests(engine, batch: int, ctx_len: int, room: int):
    """Running-like requests with pages for ctx_len + room positions (KV content is whatever
    the pool holds: the cost of a step does not depend on it)."""
    import numpy as np

    from shared.engine.request import Req
    from shared.engine.sampling_params import SamplingParams

    rng = np.random.default_rng(batch)
    vocab = engine.model_config.vocab_size
    reqs = []
    for i in range(batch):
        toks = rng.integers(10, vocab - 10, size=ctx_len + 1).tolist()
        r = Req(rid=f"b{i}", prompt_ids=toks[:-1], params=SamplingParams(temperature=0), max_new_tokens=room + 8,
                seed=0, token_ids=toks)
        pages = engine.kv.allocate(engine.kv.pages_for(ctx_len + room + 1))
        if pages is None:
            raise MemoryError(f"no KV pages for {batch} x {ctx_len} tokens")
        r.page_ids = pages
        r.num_computed = ctx_len
        reqs.append(r)
    return reqs


def _free(engine, reqs) -> None:
    for r in reqs:
        engine.kv.allocator.free(r.page_ids)
        r.page_ids = []


def _step_ms(engine, reqs, q_len: int, reps: int) -> float:
    """Forward (+ LM head over every sampling row) of one step where each request extends by
    q_len tokens (1: a decode step), through the captured graphs."""
    from shared.engine.batch import Batch, ScheduledReq
    from shared.engine.step_plan import plan_batch

    items = [ScheduledReq(r, r.num_computed, q_len, draft=[r.token_ids[-1]] * (q_len - 1) if q_len > 1 else None)
             for r in reqs]
    plan = plan_batch(Batch(items), engine.layout.page_size)
    runner = engine.runner
    return _median_ms(lambda: runner.forward_plan(plan), reps)


def _median_ms(fn, reps: int) -> float:
    """Median wall time of fn() (device synchronised), after one warm call."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def section_steps(ctx) -> None:
    import torch

    from shared.engine.speculative.uniform_graph import UniformExtendGraphs

    rep, eng, args, budget = ctx["report"], ctx["engine"], ctx["args"], ctx["budget"]
    reps = 5 if ctx["smoke"] else 20
    ctx_len = args.ctx
    batches = list(BATCHES if not ctx["smoke"] else (1, 2))
    wide = [b for b in WIDE_BATCHES if b <= eng.runner.graphs.max_bs] if eng.runner.graphs else []
    decode, verify = {}, {}
    for b in batches + wide:
        reqs = _fake_requests(eng, b, ctx_len, max(K_SWEEP) + 1)
        try:
            decode[b] = _step_ms(eng, reqs, 1, reps)
        finally:
            _free(eng, reqs)
        rep.add("steps", f"B={b} decode forward ms", decode[b])
    g = eng.runner.graphs
    for k in (K_SWEEP if not ctx["smoke"] else (1, 4)):
        if budget.left < ctx["reserve_s"]:
            rep.add("steps", f"K={k}", "skipped (time budget)")
            continue
        sizes = batches + (wide if k in WIDE_K else [])
        eng.runner.extend_graphs = UniformExtendGraphs(eng.model, eng.backend, eng.device, q_len=k + 1,
                                                       max_bs=max(sizes), max_pages=g.max_pages if g else 512,
                                                       capture=bool(g and g.capture), sizes=sizes)
        for b in sizes:
            reqs = _fake_requests(eng, b, ctx_len, k + 1)
            try:
                verify[(k, b)] = _step_ms(eng, reqs, k + 1, reps)
            finally:
                _free(eng, reqs)
            rep.add("steps", f"K={k} B={b} verify forward ms", verify[(k, b)],
                    f"x{verify[(k, b)] / decode[b]:.2f} of decode")
        eng.runner.extend_graphs = None
        gc.collect()
        if eng.device.type == "cuda":
            torch.cuda.empty_cache()
    ctx["decode_ms"], ctx["verify_ms"] = decode, verify
    # expected speed-up of n-gram drafting (its drafts cost host time only) from these forwards
    host = ctx.get("ngram_host_ms", 0.0)
    cross = {}
    for alpha in ACCEPTANCE:
        for b in sorted(decode):
            best = max(((expected_tokens(alpha, k) * decode[b] / (verify[(k, b)] + host), k)
                        for (k, bb) in verify if bb == b), default=None)
            if best is None:
                continue
            rep.add("steps", f"alpha={alpha} B={b} best speed-up", best[0], f"at K={best[1]}")
            if best[0] < 1.0 and alpha not in cross:
                cross[alpha] = b
    for alpha in ACCEPTANCE:
        below = [b for b in sorted(decode) if b < cross.get(alpha, 10**9)]
        rep.add("steps", f"alpha={alpha} speculation pays up to batch", max(below) if below else 0,
                "stops paying at " + (str(cross[alpha]) if alpha in cross else f"> {max(decode)}"))


def _one_request_tok_s(engine, prompt, new_tokens: int) -> tuple[float, int]:
    """Decode tokens/s of one request (from its first token to its last)."""
    import torch

    from shared.engine.sampling_params import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    got = 0
    t0 = None
    while engine.has_work:
        for out in engine.step():
            if out.rid == rid:
                got += len(out.token_ids)
                if t0 is None:
                    if engine.device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    first = got
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    return (got - first) / sec, got


def _periodic_prompt(vocab: int, n: int, period: int = 61) -> list[int]:
    import numpy as np

    base = np.random.default_rng(7).integers(10, vocab - 10, size=period).tolist()
    return (base * (n // period + 1))[:n]


def _timed(obj, name: str, sink: list) -> None:
    """Wrap obj.name so each call's wall time (device synchronised) lands in sink."""
    import torch

    fn = getattr(obj, name)

    def wrapped(*a, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*a, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        sink.append((time.perf_counter() - t) * 1e3)
        return out
    setattr(obj, name, wrapped)


def section_bound(ctx) -> None:
    from shared.engine.speculative.speculator import attach_speculator

    rep, eng, args, budget = ctx["report"], ctx["engine"], ctx["args"], ctx["budget"]
    prompt = _periodic_prompt(eng.model_config.vocab_size, args.ctx)
    n = 24 if ctx["smoke"] else args.new_tokens
    _one_request_tok_s(eng, prompt, 8)  # warm
    base, _ = _one_request_tok_s(eng, prompt, n)
    rep.add("bound", "B=1 no speculation tok_s", base, f"{1e3 / base:.3f} ms/token")
    ctx["base_tok_s"] = base
    methods = [("ngram", {}, 3.5), ("draft", dict(speculative_draft_model=str(ctx["draft_dir"])), 2.3),
               ("eagle3", dict(speculative_draft_model=str(ctx["eagle_dir"])), None)]
    pool = 256 if ctx["smoke"] else 4096
    for method, extra, aim in methods:
        if budget.left < ctx["reserve_s"]:
            rep.add("bound", method, "skipped (time budget)")
            continue
        try:
            t0 = time.monotonic()
            spec = attach_speculator(eng, draft_pool_pages=pool, speculative_method=method, speculative_tokens=4,
                                     speculative_accept_all=True, speculative_max_batch=32, **extra)
            rep.add("bound", f"{method} attach_sec", round(time.monotonic() - t0, 1))
            if method == "ngram":
                # the random target's first token breaks the prompt's period, so no suffix would
                # match again: propose the last token when nothing matches (accept-all keeps it),
                # after which the lookups find their matches; the machinery's ceiling
                spec.proposer.fill_when_empty = True
            draft_ms = []
            _timed(spec.proposer, "propose", draft_ms)
            _one_request_tok_s(eng, prompt, 12)  # warm (compiles, graph pools)
            draft_ms.clear()
            steps0 = spec.stats.verify_steps
            tok_s, _ = _one_request_tok_s(eng, prompt, n)
            st = spec.stats
            rep.add("bound", f"B=1 {method} K=4 accept-all tok_s", tok_s,
                    f"x{tok_s / base:.2f} of no speculation" + (f" (aim >= {aim}x)" if aim else ""))
            rep.add("bound", f"{method} mean accepted length", st.mean_accepted_length,
                    f"{st.verify_steps - steps0} verify steps")
            if draft_ms:
                rep.add("bound", f"{method} propose ms/step", sum(draft_ms[1:] or draft_ms) / len(draft_ms[1:] or draft_ms),
                        f"median {sorted(draft_ms)[len(draft_ms) // 2]:.3f}")
            if method == "draft" and draft_ms:
                # the draft's KV of the prompt made here (first proposal) against shipping it from prefill
                nbytes = len(prompt) * spec.proposer.kv_bytes_per_token
                rep.add("bound", f"draft catch-up of the {len(prompt)}-token prompt ms", draft_ms[0],
                        f"its KV is {nbytes / 1e6:.0f} MB: {nbytes / 25e9 * 1e3:.2f} ms at 25 GB/s, after prefill "
                        f"computed it too")
            if method == "ngram" and draft_ms:
                ctx["ngram_host_ms"] = sorted(draft_ms)[len(draft_ms) // 2]
            pr = spec.proposer
            if getattr(pr, "runner", None) is not None:
                gr, ex = pr.runner.graphs, pr.runner.extend_graphs
                rep.add("bound", f"{method} draft graphs",
                        f"decode {len(gr.graphs) if gr else 0} sizes, first pass {len(ex.graphs) if ex else 0} sizes "
                        f"(q={ex.q_len if ex else '-'})")
        except Exception as e:  # noqa: BLE001 - the next method still runs
            traceback.print_exc()
            rep.add("bound", f"{method} FAILED", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        finally:
            if eng.spec is not None:
                eng.spec.detach()
            gc.collect()


def section_equality(ctx) -> None:
    from shared.engine.sampling_params import SamplingParams
    from shared.engine.speculative.speculator import attach_speculator

    rep, eng, args = ctx["report"], ctx["engine"], ctx["args"]
    prompt = _periodic_prompt(eng.model_config.vocab_size, min(args.ctx, 512))
    params = SamplingParams(temperature=0, max_tokens=16 if ctx["smoke"] else 64, ignore_eos=True)

    def run():
        rid = eng.add_request(prompt, params)
        toks = []
        while eng.has_work:
            for out in eng.step():
                if out.rid == rid:
                    toks += out.token_ids
        return toks
    base = run()
    for method, extra in (("ngram", {}), ("draft", dict(speculative_draft_model=str(ctx["draft_dir"])))):
        spec = attach_speculator(eng, draft_pool_pages=256 if ctx["smoke"] else 2048, speculative_method=method,
                                 speculative_tokens=4, speculative_min_acceptance=0.0, **extra)
        try:
            got = run()
        finally:
            spec.detach()
        diff = next((i for i, (a, b) in enumerate(zip(base, got)) if a != b), None)
        rep.add("equality", f"{method} greedy == plain", diff is None and len(got) == len(base),
                f"{spec.stats.verify_steps} verify steps, {spec.stats.accepted_tokens}/{spec.stats.draft_tokens} "
                f"accepted" + ("" if diff is None else f"; first difference at token {diff} (bf16 verify vs decode)"))


SECTIONS = {"kernels": section_kernels, "steps": section_steps, "bound": section_bound, "equality": section_equality}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="spec_device", description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="kernels,steps,bound,equality")
    p.add_argument("--budget-s", type=float, default=330.0, help="stop starting work after this many seconds")
    p.add_argument("--ctx", type=int, default=1024, help="context length of the timed sequences")
    p.add_argument("--new-tokens", type=int, default=192, help="tokens of the timed request (bound)")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--draft", default="qwen3-0.6b")
    p.add_argument("--smoke", action="store_true", help="tiny shapes; CPU with TRITON_INTERPRET=1")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    from loadtest.bench.shapes import config_only_dir, hf_config
    from loadtest.bench.suite_context import Report

    budget = Budget(args.budget_s)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("spec_device needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    if args.smoke:
        args.model, args.draft, args.ctx = "qwen3-small", "llama-small", 64
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    report = Report()
    if cuda:
        props = torch.cuda.get_device_properties(dev)
        report.add("env", "device", f"{props.name}, {props.total_memory / 2**30:.0f} GiB")
    root = Path(tempfile.mkdtemp(prefix="duet-spec-"))
    ctx = dict(args=args, report=report, dev=dev, smoke=args.smoke, budget=budget, reserve_s=25.0,
               draft_dir=config_only_dir(args.draft, root),
               eagle_dir=eagle_head_dir(root, hf_config(args.model), 32000 if not args.smoke else 512))
    sections = [s for s in args.sections.split(",") if s]
    if any(s != "kernels" for s in sections):
        from shared.engine import Engine
        t0 = time.monotonic()
        opts = dict(model_dir=str(config_only_dir(args.model, root)), load_format="dummy", max_model_len=4096,
                    kv_host_memory=0, cuda_graph_max_bs=max(WIDE_BATCHES) if cuda else 8,
                    kv_cache_memory=(22 << 30) if cuda else (64 << 20), speculative_max_batch=32)
        if not cuda:
            opts.update(device="cpu", dtype="float32", cuda_graph=False)
        ctx["engine"] = Engine(**opts)
        report.add("env", "target engine start sec", round(time.monotonic() - t0, 1),
                   f"{args.model}, {ctx['engine'].weight_bytes / 2**30:.1f} GiB weights, "
                   f"{ctx['engine'].layout.num_pages} KV pages")
    # the bound's n-gram run measures the host cost the step model needs: run it first
    order = [s for s in ("kernels", "bound", "steps", "equality") if s in sections]
    for name in order:
        if budget.left < ctx["reserve_s"]:
            report.add(name, "skipped", f"time budget ({args.budget_s:.0f}s) spent")
            continue
        t0 = time.monotonic()
        try:
            SECTIONS[name](ctx)
        except Exception as e:  # noqa: BLE001 - one failing section must not waste the run
            traceback.print_exc()
            report.add(name, "FAILED", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        report.add(name, "section_sec", round(time.monotonic() - t0, 1))
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(report.data, indent=1, default=str))
    print("\n=== speculative decoding ===\n" + report.table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
