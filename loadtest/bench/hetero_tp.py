"""The `hetero_tp` section: a prefill worker at one TP size handing its KV to a decode worker at
another (`duet up --prefill-tp 2 --decode-tp 1`: prefill over both GPUs, decode sharing GPU 0,
services/launcher/gpus.py; each prefill rank writes its KV heads' slice of every page) against
the equal layout (1 -> 1: prefill GPU 0, decode GPU 1, whole pages).

A random checkpoint of the first --models shape saved once (every worker and the offline engine
read the same weights; dummy weights differ between TP sizes), in --hetero-dtype, the default
model's tokenizer (or --tokenizer-from). Per layout: greedy text of two prompts against the offline
TP=1 engine's; then for each length distinct prompts (no prefix hits), every one through the
prefill worker (the router's local prefill off): TTFT at the client and, from the prefill worker's
/metrics, the handoff tail (first token sampled -> every write landed: what the handoff adds to
TTFT), the whole transfer (first write posted -> last landed, overlapping prefill) and its bytes."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from .measure import generate, make_engine, random_prompts
from .shapes import random_checkpoint_dir
from .stack_metrics import worker_metrics_address
from .stacks import copy_tokenizer
from .tp import _call

TAIL, TRANSFER, SENT = "duet_kv_handoff_tail_seconds", "duet_kv_transfer_seconds", "duet_kv_transfer_bytes_total"
EQUALITY_NEW_TOKENS = 16


def hetero_tp(run) -> None:
    """Greedy tokens equal to offline TP=1, then the handoff tail, the transfer and its bytes by
    prompt length (the mean of --hetero-trials prompts each) for each of --hetero-layouts."""
    from transformers import AutoTokenizer

    args, dev = run.args, run.dev.type
    lengths = run.ints(args.hetero_lens or ("4096,16384" if dev == "cuda" else "96,320"))
    name = run.names(args.models)[0]
    ckpt = copy_tokenizer(run, random_checkpoint_dir(name, run.root, run.dev))
    if dev == "cuda":
        torch.cuda.empty_cache()  # the workers need the room
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    vocab = min(len(tok), _vocab(ckpt))
    max_len = -(-(max(lengths) + 64) // 1024) * 1024
    prompts = random_prompts(vocab, [50, 700 if dev == "cuda" else 120], seed=1)
    want = _call(dev, offline_tokens, dev, str(ckpt), args.hetero_dtype, prompts, max_len)
    for layout in run.names(args.hetero_layouts):
        prefill_tp, decode_tp = (int(x) for x in layout.split("->"))
        argv = ["--planner", "off", "--prefill", "1", "--decode", "1", "--prefill-tp", str(prefill_tp),
                "--decode-tp", str(decode_tp), *args.up_arg, "--model", str(ckpt), "--", "--dtype", args.hetero_dtype,
                "--max-model-len", str(max_len), *args.worker_arg]
        t0 = time.monotonic()
        try:
            with stack_of(argv, run.root / f"hetero{prefill_tp}{decode_tp}" / "logs") as s:
                run.add("hetero_tp", f"{layout} ready_s", round(time.monotonic() - t0, 1), f"duet up {' '.join(argv)}")
                _measure(run, s, layout, tok, prompts, want, lengths, vocab, _vocab(ckpt))
        except Exception as e:  # noqa: BLE001 - the next layout still runs
            run.add("hetero_tp", f"{layout} FAILED", f"{type(e).__name__}: {str(e)[:160]}")


def stack_of(argv: list[str], log_dir: Path):
    from loadtest.duet_stack import DuetStack

    return DuetStack(argv, log_dir, env={"DUET_LOCAL_PREFILL_MAX_TOKENS": "0"})  # every prompt through prefill


def _measure(run, stack, layout: str, tok, prompts, want, lengths, vocab: int, model_vocab: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=stack.url + "/v1", api_key="none", timeout=600)
    model = client.models.list().data[0].id
    same = sum(client.completions.create(model=model, prompt=p, max_tokens=len(w), temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text == tok.decode(w)
               for p, w in zip(prompts, want))
    run.add("hetero_tp", f"{layout} greedy == offline TP1", f"{same}/{len(prompts)}",
            f"{run.args.hetero_dtype}, the text of {EQUALITY_NEW_TOKENS} tokens after {len(prompts[0])} and "
            f"{len(prompts[1])} prompt tokens" + ("" if vocab == model_vocab else
                                                 f"; ids past the tokenizer's {vocab} decode to nothing"))
    metrics = worker_metrics_address(stack.log_dir, "prefill-0")
    trials = run.args.hetero_trials
    for length in lengths:
        seed = 1000 * length + 10 * int(layout[0]) + int(layout[-1])
        rows = [_one(client, model, metrics, p) for p in random_prompts(vocab, [length] * (trials + 1), seed)]
        ttft, tail, transfer, nbytes = np.mean(rows[1:], axis=0)  # the first of each length warms up
        run.add("hetero_tp", f"{layout} {length} tokens handoff tail ms", round(1e3 * tail, 2),
                f"TTFT {1e3 * ttft:.1f} ms, transfer {1e3 * transfer:.1f} ms, KV {nbytes / 2**20:.1f} MB "
                f"({nbytes / 2**30 / max(transfer, 1e-9):.2f} GB/s), mean of {trials}")


def _one(client, model: str, metrics: str, prompt: list[int]) -> tuple[float, float, float, float]:
    """(TTFT s, handoff tail s, transfer s, bytes sent) of one prompt, its first token streamed."""
    before = scrape(metrics)
    t0 = time.perf_counter()
    ttft = None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, stream=True):
        if ttft is None and chunk.choices:  # the first token (its text may be empty)
            ttft = time.perf_counter() - t0
    deadline = time.monotonic() + 30
    while (after := scrape(metrics))[f"{TAIL}_count"] <= before[f"{TAIL}_count"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the prefill worker observes the tail once the last write landed
    if after[f"{TAIL}_count"] != before[f"{TAIL}_count"] + 1:
        raise RuntimeError(f"the prefill worker's handoffs went {before[f'{TAIL}_count']:.0f} -> "
                           f"{after[f'{TAIL}_count']:.0f} for one prompt")
    return (ttft or 0.0, *(after[k] - before[k] for k in (f"{TAIL}_sum", f"{TRANSFER}_sum", SENT)))


def scrape(address: str) -> dict[str, float]:
    """The prefill worker's handoff and transfer totals, from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {f"{TAIL}_sum", f"{TAIL}_count", f"{TRANSFER}_sum"}
    found = dict.fromkeys([*wanted, SENT], 0.0)
    for family in text_string_to_metric_families(httpx.get(f"http://{address}/metrics", timeout=5).text):
        for s in family.samples:
            if s.name in wanted or (s.name == SENT and s.labels.get("direction") == "sent"):
                found[s.name] = s.value
    return found


def _vocab(folder: Path) -> int:
    import json

    return json.loads((folder / "config.json").read_text())["vocab_size"]


def offline_tokens(device: str, ckpt: str, dtype: str, prompts, max_len: int) -> list[list[int]]:
    eng = make_engine(torch.device(device), ckpt, dtype=dtype, max_model_len=max_len,
                      kv_cache_memory=(4 << 30) if device == "cuda" else 256 << 20)
    try:
        return generate(eng, prompts, EQUALITY_NEW_TOKENS)
    finally:
        eng.close()
