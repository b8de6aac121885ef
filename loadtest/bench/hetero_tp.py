"""Prefill and decode at different TP sizes on two GPUs (the two-GPU check of heterogeneous TP):

    python3 -m loadtest.bench.hetero_tp --shape qwen3-0.6b --prompt-lens 4096,16384 --tokenizer-from .tok

A random fp32 checkpoint of a real shape (saved once, so every worker loads the same
weights) served by `duet up --prefill-tp 2 --decode-tp 1`: prefill over both GPUs, decode
sharing GPU 0 (services/launcher/gpus.py), KV re-sharded by heads on the way. Then the same
with both at TP 1 (prefill GPU 0, decode GPU 1; whole-page writes) for comparison.
- greedy equality: the stack's completions equal the offline TP=1 engine's (fp32);
- handoff: for each prompt length, distinct prompts (no prefix-cache hits), TTFT at the
  client, and from the prefill worker's metrics the handoff tail (first token sampled ->
  every write landed: what the handoff adds to TTFT), the whole transfer's time (first
  write posted -> last landed, overlapping prefill) and the bytes.
Prints a short table last; JSON under --out."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

from .stack_runs import copy_tokenizer, run_each, start_run

LAYOUTS = {"2->1": (2, 1), "1->1": (1, 1), "1->2": (1, 2), "2->2": (2, 2)}


def checkpoint(shape: str, root: pathlib.Path, tokenizer_from: str) -> pathlib.Path:
    import torch

    from .shapes import random_checkpoint_dir
    d = random_checkpoint_dir(shape, root, torch.device("cuda:0"))
    copy_tokenizer(pathlib.Path(tokenizer_from), d)
    torch.cuda.empty_cache()
    return d


def prompt_texts(tok, n: int, length: int, seed: int) -> list[str]:
    import random
    rng = random.Random(seed)
    return [tok.decode([rng.randrange(1000, 40000) for _ in range(length)]) for _ in range(n)]


def reference(model: pathlib.Path, prompts: list[list[int]], max_tokens: int, max_len: int) -> list[list[int]]:
    from shared.engine import LLM, SamplingParams

    from .gpu_engine import release_memory
    llm = LLM(str(model), dtype="float32", device="cuda:0", max_model_len=max_len, kv_cache_memory=4 << 30)
    out = [r.token_ids for r in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))]
    llm.engine.close()
    del llm
    release_memory()
    return out


def scrape(url: str) -> dict[str, float]:
    """The prefill worker's handoff and transfer totals from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    wanted = {"duet_kv_handoff_tail_seconds_sum", "duet_kv_handoff_tail_seconds_count",
              "duet_kv_transfer_seconds_sum", "duet_kv_transfer_seconds_count"}
    vals = {}
    for family in text_string_to_metric_families(httpx.get(f"http://{url}/metrics", timeout=5).text):
        for s in family.samples:
            if s.name in wanted:
                vals[s.name] = s.value
            elif s.name == "duet_kv_transfer_bytes_total" and s.labels.get("direction") == "sent":
                vals[s.name] = s.value
    return vals


def redis_url(up_log: pathlib.Path, timeout_s: float = 60.0) -> str:
    """duet up prints its Redis URL once the gateway is healthy, a moment after /health says so."""
    from services.launcher.banner import registry_url_in
    end = time.monotonic() + timeout_s
    while True:
        url = registry_url_in(up_log.read_text())  # with the password, when the stack has one
        if url or time.monotonic() > end:
            return url or ""
        time.sleep(0.5)


def run_layout(name: str, model: pathlib.Path, args, tok, equal_prompts, want, out: pathlib.Path) -> list[dict]:
    import redis
    from openai import OpenAI

    from loadtest.duet_stack import DuetStack
    p, d = LAYOUTS[name]
    up = ["--prefill-tp", str(p), "--decode-tp", str(d), "--model", str(model), "--",
          "--dtype", "float32", "--max-model-len", str(args.max_model_len), "--page-size", str(args.page_size)]
    rows = []
    t0 = time.monotonic()
    with DuetStack(up, out / name.replace(">", "") / "logs") as stack:
        ready_s = time.monotonic() - t0
        r = redis.Redis.from_url(redis_url(out / name.replace(">", "") / "logs" / "up.log"), decode_responses=True)
        metrics_url = r.hgetall("duet:worker:prefill-0")["metrics"]
        client = OpenAI(base_url=stack.url + "/v1", api_key="none", timeout=600)
        mid = client.models.list().data[0].id
        equal = 0
        for ptext, ref in zip(equal_prompts, want):
            c = client.completions.create(model=mid, prompt=ptext, max_tokens=args.max_tokens, temperature=0)
            equal += c.choices[0].text == tok.decode(ref)
        rows.append(dict(layout=name, kind="equality", equal=equal, of=len(want), ready_s=ready_s))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        for length in args.prompt_lens:
            warm = length == args.prompt_lens[0]  # one warm-up request before the first length only
            texts = prompt_texts(tok, args.trials + warm, length, seed=length + 7 * p + d)
            for i, ptext in enumerate(texts):
                before = scrape(metrics_url)
                t = time.perf_counter()
                stream = client.completions.create(model=mid, prompt=ptext, max_tokens=2, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
                ttft, usage = None, None
                for chunk in stream:
                    if ttft is None and chunk.choices:  # the first token (its text may be empty)
                        ttft = time.perf_counter() - t
                    usage = chunk.usage or usage
                time.sleep(0.2)  # the prefill worker settles its metrics after the RPC answer
                after = scrape(metrics_url)
                delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                if warm and i == 0:
                    continue
                rows.append(dict(layout=name, kind="handoff", prompt_tokens=usage.prompt_tokens if usage else length,
                                 ttft_ms=1e3 * (ttft or 0),
                                 tail_ms=1e3 * delta.get("duet_kv_handoff_tail_seconds_sum", 0),
                                 transfer_ms=1e3 * delta.get("duet_kv_transfer_seconds_sum", 0),
                                 kv_mb=delta.get("duet_kv_transfer_bytes_total", 0) / 2**20))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.hetero_tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--layouts", default="2->1,1->1", help="prefill->decode TP sizes, comma list")
    p.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
    p.add_argument("--trials", type=int, default=2, help="measured prompts per length")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens compared per equality prompt")
    p.add_argument("--max-model-len", type=int, default=17408)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--tokenizer-from", required=True, help="folder with the default model's tokenizer files")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "hetero-tp"))
    args = p.parse_args(argv)
    out = start_run(args.out)
    from transformers import AutoTokenizer
    model = checkpoint(args.shape, pathlib.Path(tempfile.mkdtemp(prefix="hetero-tp-")), args.tokenizer_from)
    tok = AutoTokenizer.from_pretrained(str(model))
    equal_prompts = ["The river bends twice before it reaches the sea, and"] + prompt_texts(tok, 2, 700, 1) + \
        prompt_texts(tok, 1, 3000, 2)
    t = time.monotonic()
    want = reference(model, [tok.encode(x) for x in equal_prompts], args.max_tokens, args.max_model_len)
    print(f"reference (offline TP=1, fp32) in {time.monotonic() - t:.0f}s", file=sys.stderr, flush=True)
    rows = run_each(args.layouts, lambda name: run_layout(name, model, args, tok, equal_prompts, want, out))
    (out / "hetero_tp.json").write_text(json.dumps(rows, indent=1))
    print(f"\n=== hetero_tp: {args.shape} fp32, prefill->decode TP, greedy equality vs offline TP=1 and "
          f"the KV handoff (mean of {args.trials}) ===")
    for r in (r for r in rows if r["kind"] == "equality"):
        print(f"{r['layout']:<6} greedy equal {r['equal']}/{r['of']} (ready in {r['ready_s']:.0f}s)")
    print(f"{'layout':<7}{'prompt':>7}{'TTFT ms':>9}{'tail ms':>9}{'xfer ms':>9}{'KV MB':>8}{'GB/s':>7}")
    for name in dict.fromkeys(r["layout"] for r in rows):
        for length in args.prompt_lens:
            rs = [r for r in rows if r["layout"] == name and r["kind"] == "handoff"
                  and abs(r["prompt_tokens"] - length) < length // 4]
            if not rs:
                continue
            m = {k: sum(r[k] for r in rs) / len(rs) for k in ("prompt_tokens", "ttft_ms", "tail_ms", "transfer_ms",
                                                               "kv_mb")}
            gbs = m["kv_mb"] / 1024 / (m["transfer_ms"] / 1e3) if m["transfer_ms"] else 0
            print(f"{name:<7}{m['prompt_tokens']:>7.0f}{m['ttft_ms']:>9.1f}{m['tail_ms']:>9.1f}"
                  f"{m['transfer_ms']:>9.1f}{m['kv_mb']:>8.0f}{gbs:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
