"""The one-device sections of `duet bench` (suite.py lists them all)."""
from __future__ import annotations

import time

import torch

from .measure import decode_floor_ms, decode_step_ms, generate, prefill_rate, random_prompts, with_engine
from .shapes import config_only_dir, hf_config, measure_ceilings, random_checkpoint_dir, sync

FP8 = {"quantization": "fp8"}
FP8_KV = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}
FP8_VARIANTS = (("bf16", {}), ("fp8", FP8), ("fp8+fp8kv", FP8_KV))


def ceilings(run) -> None:
    c = run.ceilings = measure_ceilings(run.dev)
    run.add("ceilings", "copy_GB_s", c.copy_gb_s, "read + write, eager device copy")
    run.add("ceilings", "bf16_matmul_TFLOPs", c.matmul_tflops, "square product, random data")
    run.add("ceilings", "fp8_matmul_TFLOPs", c.fp8_matmul_tflops, "torch._scaled_mm e4m3, per-tensor scales")


def equality(run) -> None:
    """Greedy tokens of the engine and of transformers on one random checkpoint in float32
    (float64 on the CPU), where neither rounds differently: every sequence should be identical."""
    from transformers import AutoModelForCausalLM

    dtype = exact_dtype(run.dev)
    for name in run.names(run.args.small_models):
        ckpt = random_checkpoint_dir(name, run.root, run.dev)
        prompts = equality_prompts(hf_config(name).vocab_size)
        ours = with_engine(run, ckpt, lambda eng: generate(eng, prompts, 48), dtype=str(dtype).removeprefix("torch."))
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(run.dev).eval()
        same = 0
        for p, o in zip(prompts, ours):
            ids = torch.tensor([p], device=run.dev)
            with torch.inference_mode():
                got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(o),
                                     eos_token_id=None, do_sample=False)  # EOS is a token like any, as ignore_eos
            same += got[0, len(p):].tolist() == o
        run.add("equality", f"{name} {str(dtype).removeprefix('torch.')} identical sequences", f"{same}/{len(prompts)}")
        del model


def exact_dtype(device) -> torch.dtype:
    return torch.float32 if device.type == "cuda" else torch.float64


def equality_prompts(vocab: int, n: int = 4) -> list[list[int]]:
    lengths = torch.randint(8, 200, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    return random_prompts(vocab, lengths, seed=3)


def decode(run, section: str = "decode", variants=(("", {}),)) -> dict:
    """Step ms of each --models shape at each batch against the bytes floor, plain and with
    overlap (the workers' default); graphs off at batch 1 and 32. Returns the overlap figures."""
    c, args, found = run.need_ceilings(), run.args, {}
    batches = run.ints(args.batches)

    def measure(eng, label):
        run.add(section, f"{label} engine", f"weights {eng.weight_bytes / 2**30:.2f} GiB ({eng.weights_description}), "
                f"KV {eng.layout.num_pages} pages of {str(eng.kv_dtype).removeprefix('torch.')}")
        for b in batches:
            floor, gb = decode_floor_ms(eng, b, args.ctx, c.copy_gb_s)
            ms = decode_step_ms(eng, b, args.ctx, args.steps)
            run.add(section, f"{label} B={b} step_ms", ms, f"floor {floor:.3f} ms ({gb:.2f} GB), x{ms / floor:.2f}")
            found[label, b] = ms = decode_step_ms(eng, b, args.ctx, args.steps, overlap=True)
            run.add(section, f"{label} B={b} step_ms overlap", ms, f"x{ms / floor:.2f} of floor")
            if section == "decode" and b in (1, 32) and eng.runner.graphs is not None:
                run.add(section, f"{label} B={b} step_ms graphs_off",
                        decode_step_ms(eng, b, args.ctx, args.steps, graphs=False))

    for name in run.names(args.models):
        for tag, options in variants:
            label = f"{name} {tag}".strip()
            with_engine(run, name, lambda eng: measure(eng, label), max_model_len=max(4096, 2 * args.ctx),
                        cuda_graph_max_bs=max(batches), **options)
    return found


def prefill(run, section: str = "prefill", variants=(("", {}),)) -> dict:
    """Tokens/s from queueing --prefill-prompts prompts to their first tokens; TFLOP/s against
    the matmul peak (FP8 weights: the FP8 peak). Each size is warmed first (its GEMM tilings
    compile outside the timed run). Returns tokens/s by (label, prompts)."""
    c, args, found = run.need_ceilings(), run.args, {}

    def measure(eng, label, fp8):
        peak = c.fp8_matmul_tflops if fp8 and c.fp8_matmul_tflops else c.matmul_tflops
        for n in run.ints(args.prefill_prompts):
            prefill_rate(eng, n, args.prefill_len, seed=100 + n)
            r = prefill_rate(eng, n, args.prefill_len, seed=n)
            found[label, n] = r["tok_s"]
            run.add(section, f"{label} {n}x{args.prefill_len} tok_s", r["tok_s"],
                    f"{r['tflops']:.3g} TFLOP/s, {100 * r['tflops'] / peak:.0f}% of the {('bf16', 'FP8')[fp8]} peak")

    for name in run.names(args.models):
        for tag, options in variants:
            label = f"{name} {tag}".strip()
            with_engine(run, name, lambda eng: measure(eng, label, bool(options)), max_model_len=args.prefill_len + 64,
                        max_num_batched_tokens=max(16384, args.prefill_len), **options)
    return found


def offline(run) -> None:
    """--offline-requests random requests queued at once on the first --models shape, prompt
    and output lengths uniform in [ctx/10, ctx] (mini-sglang's offline shape at ctx 1024), with
    the overlap scheduler off and on: output tokens/s, and the same tokens either way."""
    name, n, hi = run.names(run.args.models)[0], run.args.offline_requests, run.args.ctx
    gen = torch.Generator().manual_seed(7)
    ins, outs = (torch.randint(max(1, hi // 10), hi + 1, (n,), generator=gen).tolist() for _ in range(2))
    vocab = hf_config(name).vocab_size
    prompts, warm = random_prompts(vocab, ins, seed=7), random_prompts(vocab, [hi // 2] * 8, seed=1)
    tokens = {}

    def measure(eng, overlap):
        generate(eng, warm, 16)
        sync(eng.device)
        t0 = time.perf_counter()
        tokens[overlap] = generate(eng, prompts, outs)
        sync(eng.device)
        sec = time.perf_counter() - t0
        run.add("offline", f"{name} overlap={'on' if overlap else 'off'} out_tok_s", sum(outs) / sec,
                f"{n} requests in {sec:.1f}s, total {(sum(outs) + sum(ins)) / sec:.0f} tok/s")

    for overlap in (False, True):
        with_engine(run, name, lambda eng: measure(eng, overlap), overlap_schedule=overlap,
                    max_model_len=max(4096, 2 * hi + 64))
    same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
    run.add("offline", "overlap on/off identical sequences", f"{same}/{n}",
            "batch shapes differ between the two loops, so bf16 near-ties may flip")


def fp8(run) -> None:
    """FP8 weights (quantized at load) and FP8 weights + FP8 KV beside bf16: the decode steps
    (overlap) and prefill of each --models shape; floors in each variant's own bytes."""
    steps, rates = decode(run, "fp8", FP8_VARIANTS), prefill(run, "fp8", FP8_VARIANTS)
    for name in run.names(run.args.models):
        for b in run.ints(run.args.batches):
            run.add("fp8", f"{name} B={b} bf16/fp8 step", steps[f"{name} bf16", b] / steps[f"{name} fp8", b],
                    f"fp8+fp8kv {steps[f'{name} bf16', b] / steps[f'{name} fp8+fp8kv', b]:.3f}")
        for n in run.ints(run.args.prefill_prompts):
            run.add("fp8", f"{name} {n} prompts fp8/bf16 prefill", rates[f"{name} fp8", n] / rates[f"{name} bf16", n])


def spec(run) -> None:
    """Speculative decoding, K=4, the last --models shape the target: n-gram lookup and a draft
    model (the first --models shape). Greedy tokens with real verification must equal the plain
    engine's; then one request at batch 1 with every draft token accepted (the method's
    ceiling: what its machinery costs, whatever a model would accept) against no speculation."""
    from shared.engine.speculative.speculator import attach_speculator

    names, pool = run.names(run.args.models), 4096 if run.dev.type == "cuda" else 256
    methods = {"ngram": {}, "draft": {"speculative_draft_model": str(config_only_dir(names[0], run.root))}}

    def measure(eng):
        period = random_prompts(eng.model_config.vocab_size, [61], seed=7)[0]
        prompt = (period * (run.args.ctx // 61 + 1))[:run.args.ctx]
        plain = generate(eng, [prompt[:512]], 64)[0]
        one_request_tok_s(eng, prompt, 8)
        base = one_request_tok_s(eng, prompt, 6 * run.args.steps)
        run.add("spec", "B=1 no speculation tok_s", base, f"{1e3 / base:.3f} ms a token")
        for method, extra in methods.items():
            sp = attach_speculator(eng, draft_pool_pages=pool, speculative_method=method, speculative_tokens=4,
                                   speculative_min_acceptance=0.0, **extra)
            try:
                got = generate(eng, [prompt[:512]], 64)[0]
                first = next((i for i, (a, b) in enumerate(zip(plain, got)) if a != b), None)
                run.add("spec", f"{method} greedy == plain", first is None, f"{sp.stats.accepted_tokens}/"
                        f"{sp.stats.draft_tokens} drafts accepted" + ("" if first is None else f"; differs at {first}"))
                # the random target breaks the prompt's period at once: n-gram lookups propose the
                # last token when nothing matches, which accept-all keeps, so lookups match again
                sp.accept_all, sp.proposer.fill_when_empty = True, method == "ngram"
                one_request_tok_s(eng, prompt, 12)
                sp.reset_stats()
                tok_s = one_request_tok_s(eng, prompt, 6 * run.args.steps)
                run.add("spec", f"B=1 {method} K=4 accept-all tok_s", tok_s, f"x{tok_s / base:.2f} of none, mean "
                        f"accepted length {sp.stats.mean_accepted_length:.2f} in {sp.stats.verify_steps} verify steps")
            finally:
                sp.detach()

    with_engine(run, names[-1], measure, max_model_len=max(4096, 2 * run.args.ctx), kv_host_memory=0,
                cuda_graph_max_bs=32, speculative_max_batch=32)


def one_request_tok_s(engine, prompt, new_tokens: int) -> float:
    """Decode tokens/s of one request, from its first token to its last."""
    from shared.engine import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    got, first, t0 = 0, 0, 0.0
    while engine.has_work:
        got += sum(len(out.token_ids) for out in engine.step() if out.rid == rid)
        if got and not t0:
            sync(engine.device)
            first, t0 = got, time.perf_counter()
    sync(engine.device)
    return (got - first) / (time.perf_counter() - t0)
