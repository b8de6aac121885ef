"""The transformers peer for `duet bench`, and greedy equality against transformers.

Peer timings use transformers' own model on the same shapes (random weights, bf16, SDPA):
decode ms/step with a static cache under torch.compile(mode="reduce-overhead") (what
`generate(cache_implementation="static")` auto-compiles), and plain eager `generate`.
ms/step = (T(generate N tokens) - T(generate 1 token)) / (N - 1): the prompt's prefill
cancels out. Equality: greedy tokens of our engine and of transformers on the same
checkpoint, in float32 on the GPU (no bf16 rounding in either), plus teacher-forced top-1
agreement in bf16 (transformers reads our bf16 output and predicts each next token)."""
from __future__ import annotations

import gc

import numpy as np
import torch

from .shapes import hf_config, now


def hf_model(name: str, device, dtype=torch.bfloat16, path=None):
    """transformers' own model (MoE: with its default experts implementation, what a user
    gets; `experts_impl(model)` names it)."""
    from transformers import AutoModelForCausalLM

    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.device(device):  # random init on the GPU: seconds, even for 8B
        return AutoModelForCausalLM.from_config(hf_config(name), dtype=dtype).eval()


def experts_impl(model) -> str:
    return str(getattr(model.config, "_experts_implementation", None) or "eager")


def _generate_sec(model, ids, new_tokens: int, **kw) -> float:
    torch.cuda.synchronize()
    t0 = now()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, **kw)
    torch.cuda.synchronize()
    return now() - t0


def hf_decode_ms(model, batch: int, ctx: int, new_tokens: int = 64, compiled: bool = False) -> float:
    vocab = model.config.vocab_size
    ids = torch.randint(10, vocab - 10, (batch, ctx), device=model.device)
    kw = {}
    if compiled:
        from transformers import CompileConfig
        kw = dict(cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
    for _ in range(2):  # compile / warm both shapes
        _generate_sec(model, ids, new_tokens, **kw)
    full = min(_generate_sec(model, ids, new_tokens, **kw) for _ in range(2))
    one = min(_generate_sec(model, ids, 1, **kw) for _ in range(2))
    return (full - one) / (new_tokens - 1) * 1e3


def compiled_decode_ms(name: str, device: str, ctx: int) -> float:
    """In a fresh process (bench.tp.in_fresh_process): B=1 ms/step of the compiled peer."""
    model = hf_model(name, torch.device(device))
    return hf_decode_ms(model, 1, ctx, compiled=True)


def hf_offline(model, prompts, out_lens, sub_batch: int, max_sub_batches: int | None) -> dict:
    """The offline workload through generate in sub-batches (left padding); each sub-batch
    runs to its longest wanted output, only wanted tokens count."""
    pad = 0
    done_tokens, sec, n_req = 0, 0.0, 0
    order = list(range(len(prompts)))
    batches = [order[i:i + sub_batch] for i in range(0, len(order), sub_batch)]
    if max_sub_batches:
        batches = batches[:max_sub_batches]
    for idx in batches:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):
            p = prompts[i]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        want = max(out_lens[i] for i in idx)
        torch.cuda.synchronize()
        t0 = now()
        with torch.inference_mode():
            model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=want,
                           min_new_tokens=want, do_sample=False, pad_token_id=pad)
        torch.cuda.synchronize()
        sec += now() - t0
        done_tokens += sum(out_lens[i] for i in idx)
        n_req += len(idx)
    return dict(requests=n_req, sec=sec, out_tok_s=done_tokens / sec, sub_batch=sub_batch)


def free(model) -> None:
    del model
    gc.collect()
    torch.cuda.empty_cache()


def greedy_equality(ckpt_dir, device, prompts, new_tokens: int) -> dict:
    """Our engine vs transformers on one checkpoint: exact greedy tokens in float32, and
    teacher-forced top-1 agreement in bf16."""
    from shared.engine import Engine, SamplingParams

    result = {}
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        eng = Engine(model_dir=str(ckpt_dir), dtype=dtype_name, kv_cache_memory=1 << 30)
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        rids = [eng.add_request(p, params) for p in prompts]
        toks = {r: [] for r in rids}
        while eng.has_work:
            for out in eng.step():
                toks[out.rid] += out.token_ids
        ours = [toks[r] for r in rids]
        eng.close()
        del eng
        gc.collect()
        torch.cuda.empty_cache()
        model = hf_model(None, device, dtype, path=ckpt_dir)
        if dtype is torch.float32:
            same = 0
            for p, o in zip(prompts, ours):
                ids = torch.tensor([p], device=device)
                with torch.inference_mode():
                    g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, do_sample=False)
                same += int(g[0, len(p):].tolist() == o)
            result["fp32_identical_sequences"] = f"{same}/{len(prompts)}"
        else:
            agree = total = 0
            for p, o in zip(prompts, ours):
                ids = torch.tensor([p + o], device=device)
                with torch.inference_mode():
                    logits = model(ids).logits[0, len(p) - 1:-1]
                pred = logits.argmax(-1).tolist()
                agree += sum(int(a == b) for a, b in zip(pred, o))
                total += len(o)
            result["bf16_teacher_forced_top1"] = round(agree / total, 4)
        free(model)
    return result


def equality_prompts(vocab: int, n: int = 4, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, size=int(rng.integers(8, 200))).tolist() for _ in range(n)]
