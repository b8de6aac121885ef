"""Offline CPU throughput: our engine against transformers' `generate` on the same batch.

A batch of random-token prompts (input and output lengths drawn uniformly from
[min-len, max-len], ignore_eos so every request makes exactly its wanted tokens) runs
  1. through our engine (continuous batching, chunked prefill, paged KV), all at once;
  2. through HF `generate`, batched: left padding, one call for the whole batch with
     max_new_tokens = the longest wanted output; only each prompt's wanted tokens count
     as useful output (the rest is padding work HF cannot skip);
  3. through HF `generate` one prompt at a time, on a subset, extrapolated to the batch.
Default model (the embedded SmolLM2-135M), float32, greedy.

    PYTHONPATH=. python -m loadtest.bench.cpu_engine [--num-prompts 64 --min-len 100 --max-len 500
        --threads N --sequential-prompts 4 --json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Measurement:
    name: str
    seconds: float
    output_tokens: int  # useful (wanted) output tokens
    input_tokens: int
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds


def make_workload(n: int, min_len: int, max_len: int, min_out: int, max_out: int, vocab: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    # skip the low ids (special tokens in most vocabularies)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]
    return Workload(prompts, [rng.randint(min_out, max_out) for _ in range(n)])


# -- our engine ------------------------------------------------------------------------------
def kv_bytes_needed(model_dir, w: Workload, dtype_bytes: int, page_size: int) -> int:
    from shared.engine.model_config import ModelConfig
    mc = ModelConfig.from_dir(model_dir)
    per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * dtype_bytes
    pages = sum(-(-(len(p) + o) // page_size) for p, o in zip(w.prompts, w.output_lens)) + 2
    return pages * page_size * per_token


def bench_engine(model_dir, w: Workload, args) -> Measurement:
    from shared.engine.engine import Engine
    from shared.engine.sampling_params import SamplingParams
    kv = int(args.kv_gib * 2**30) if args.kv_gib else kv_bytes_needed(model_dir, w, 4, args.page_size)
    eng = Engine(model_dir=str(model_dir), dtype=args.dtype, num_threads=args.threads, page_size=args.page_size,
                 kv_cache_memory=kv, max_num_batched_tokens=args.max_num_batched_tokens,
                 max_running_requests=args.max_running_requests, enable_prefix_cache=False)
    # warm-up: one short request, so first-call costs are not timed
    eng.add_request(w.prompts[0][:16], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while eng.has_work:
        eng.step()
    warm_steps = eng.stats.steps
    t0 = time.perf_counter()
    for p, o in zip(w.prompts, w.output_lens):
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
    made = 0
    while eng.has_work:
        made += sum(len(out.token_ids) for out in eng.step())
    secs = time.perf_counter() - t0
    assert made == w.output_tokens, (made, w.output_tokens)
    eng.check_idle()
    return Measurement("engine", secs, made, w.input_tokens,
                       extra=dict(steps=eng.stats.steps - warm_steps, retracted=eng.scheduler.num_retracted,
                                  kv_mib=round(kv / 2**20), page_size=args.page_size,
                                  max_num_batched_tokens=eng.scheduler.max_batched_tokens))


# -- transformers ----------------------------------------------------------------------------
def _hf_generate(model, batch_ids: list[list[int]], max_new: int, pad_id: int):
    import torch
    from transformers import GenerationConfig
    width = max(map(len, batch_ids))
    ids = torch.full((len(batch_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch_ids):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    cfg = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                           pad_token_id=pad_id, eos_token_id=None)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    assert out.shape[1] == width + max_new
    return out


def load_hf(model_dir, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


def bench_hf_batched(model, w: Workload, pad_id: int) -> Measurement:
    _hf_generate(model, [w.prompts[0][:16]], 4, pad_id)  # warm-up
    t0 = time.perf_counter()
    _hf_generate(model, w.prompts, max(w.output_lens), pad_id)
    secs = time.perf_counter() - t0
    return Measurement("hf_batched", secs, w.output_tokens, w.input_tokens,
                       note=f"one generate() call, left padding, max_new_tokens={max(w.output_lens)}; "
                            f"only wanted tokens counted",
                       extra=dict(generated_incl_padding=len(w.prompts) * max(w.output_lens)))


def bench_hf_sequential(model, w: Workload, pad_id: int, n: int) -> Measurement:
    n = min(n, len(w.prompts))
    secs = 0.0
    for p, o in zip(w.prompts[:n], w.output_lens[:n]):
        t0 = time.perf_counter()
        _hf_generate(model, [p], o, pad_id)
        secs += time.perf_counter() - t0
    sub_out, sub_in = sum(w.output_lens[:n]), sum(map(len, w.prompts[:n]))
    # extrapolate by output tokens: the measured subset rate applied to the whole batch
    scale = w.output_tokens / sub_out
    return Measurement("hf_sequential", secs * scale, w.output_tokens, w.input_tokens,
                       note=f"measured {n} of {len(w.prompts)} prompts one at a time "
                            f"({sub_in} in / {sub_out} out tokens, {secs:.1f}s), extrapolated",
                       extra=dict(measured_prompts=n, measured_seconds=round(secs, 2)))


# -- main --------------------------------------------------------------------------------------
def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.cpu_engine", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100, help="shortest prompt (tokens)")
    ap.add_argument("--max-len", type=int, default=500, help="longest prompt (tokens)")
    ap.add_argument("--min-out", type=int, default=None, help="shortest output (default: --min-len)")
    ap.add_argument("--max-out", type=int, default=None, help="longest output (default: --max-len)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all cores)")
    ap.add_argument("--sequential-prompts", type=int, default=4,
                    help="prompts HF runs one at a time (the rest is extrapolated); 0 skips")
    ap.add_argument("--skip-hf-batched", action="store_true")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=None, help="engine KV budget (default: what the batch needs)")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    args.min_out = args.min_len if args.min_out is None else args.min_out
    args.max_out = args.max_len if args.max_out is None else args.max_out
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    torch.set_num_threads(args.threads)
    from shared.model_files.default_model import resolve_model_dir
    from shared.engine.model_config import ModelConfig
    model_dir = resolve_model_dir(args.model, progress=False)
    mc = ModelConfig.from_dir(model_dir)
    w = make_workload(args.num_prompts, args.min_len, args.max_len, args.min_out, args.max_out,
                      mc.vocab_size, args.seed)
    print(f"model {model_dir.name} ({mc.architecture}), {args.dtype}, CPU, threads {torch.get_num_threads()} "
          f"of {os.cpu_count()} cores")
    print(f"workload: {len(w.prompts)} prompts, input {args.min_len}-{args.max_len} ({w.input_tokens} tokens), "
          f"output {args.min_out}-{args.max_out} ({w.output_tokens} tokens), greedy, ignore_eos, seed {args.seed}")
    results = [bench_engine(model_dir, w, args)]
    _report(results[-1])
    pad_id = mc.eos_token_ids[0] if mc.eos_token_ids else 0
    if not args.skip_hf_batched or args.sequential_prompts:
        hf = load_hf(model_dir, args.dtype)
        if not args.skip_hf_batched:
            results.append(bench_hf_batched(hf, w, pad_id))
            _report(results[-1])
        if args.sequential_prompts:
            results.append(bench_hf_sequential(hf, w, pad_id, args.sequential_prompts))
            _report(results[-1])
    eng = results[0]
    for r in results[1:]:
        print(f"engine / {r.name}: {eng.output_tok_s / r.output_tok_s:.2f}x output tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), threads=torch.get_num_threads(),
                           results=[dict(asdict(r), output_tok_s=r.output_tok_s, total_tok_s=r.total_tok_s)
                                    for r in results]), f, indent=2)
    return 0


def _report(m: Measurement) -> None:
    print(f"{m.name:14s} {m.seconds:8.1f}s  output {m.output_tok_s:8.1f} tok/s  "
          f"(in+out {m.total_tok_s:8.1f} tok/s)  {m.note} {m.extra or ''}".rstrip(), flush=True)


if __name__ == "__main__":
    sys.exit(main())
