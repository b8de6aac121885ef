"""A wave of follow-up turns through the gateway's prompt preparation (CPU only).

Every turn of a conversation is rendered with the model's chat template and tokenized whole, in
the gateway's helper processes (services/gateway/openai_api/chat_renderer.py). When many
conversations send their next turn at once (the multi-turn benches' lockstep waves, or a burst
of users), the turns queue for those helpers. This bench sends N distinct conversations' next
turns at once through the real ChatRenderer and prints, for each helper count, the wave's wall
time and the per-turn latency (what a turn adds to its TTFT before routing).

    python -m loadtest.bench.chat_render_wave [--tokenizer DIR] [--conversations 48] [--processes 1,2,4,8]

The conversations are the multi-turn load generator's synthetic ones (loadtest/multiturn/
synthetic_dialogs.py, the shape loadtest/bench/multiturn_device.py drives), sent at their last
turn. (The figures in the notes, 6331 tokens a turn, were made with word-sampled chats before
this reuse: commit 12edd00.)
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

from loadtest.multiturn.synthetic_dialogs import SyntheticShape, synthetic_dialogs
from loadtest.tokenizer_source import TokenCounter
from loadtest.workloads.synthetic_text import SyntheticText


def conversations(tokenizer, shape: SyntheticShape, seed: int = 0) -> list[list[dict]]:
    """The multi-turn bench's conversations (loadtest/multiturn/synthetic_dialogs.py: a system
    prompt of system_len tokens, user turns of user_len) at their last turn: every earlier turn
    answered with output_len tokens, the messages a client sends for that last turn."""
    text = SyntheticText(TokenCounter(tokenizer), random.Random(seed))
    out = []
    for dialog in synthetic_dialogs(shape, text):
        msgs = list(dialog.opening)
        for turn in dialog.turns[:-1]:
            msgs += [{"role": "user", "content": turn.user},
                     {"role": "assistant", "content": text.text(turn.output_len)}]
        out.append(msgs + [{"role": "user", "content": dialog.turns[-1].user}])
    return out


async def one_wave(renderer, convos) -> tuple[float, list[float], int]:
    """(wall seconds, each turn's seconds, tokens of the first turn)."""
    async def timed(msgs):
        t = time.perf_counter()
        ids = await renderer.chat_prompt_ids(msgs, None, None)
        return time.perf_counter() - t, len(ids)

    t0 = time.perf_counter()
    done = await asyncio.gather(*(timed(m) for m in convos))
    return time.perf_counter() - t0, [d[0] for d in done], done[0][1]


async def run(args) -> list[tuple]:
    from services.gateway.openai_api.chat_renderer import ChatRenderer
    from services.gateway.openai_api.prompt_builder import PromptBuilder
    from services.gateway.openai_api.template_config import ChatTemplateConfig
    from shared.model_files.default_model import resolve_model_dir

    builder = PromptBuilder.from_model_dir(args.tokenizer or resolve_model_dir(None, progress=False))
    convos = conversations(builder.tokenizer, SyntheticShape(args.conversations, args.system_len, args.turns))
    rows = []
    for processes in (int(v) for v in args.processes.split(",")):
        renderer = ChatRenderer(builder, ChatTemplateConfig(processes=processes, timeout_s=120.0))
        try:
            await one_wave(renderer, convos[:processes] * 2)  # every helper started and warm
            best = None
            for _ in range(args.waves):
                wall, each, tokens = await one_wave(renderer, convos)
                if best is None or wall < best[0]:
                    best = (wall, sorted(each), tokens)
        finally:
            renderer.close()
        wall, each, tokens = best
        rows.append((processes, wall, each[len(each) // 2], each[-1], tokens))
        print(f"processes {processes}: wave {wall * 1e3:.0f} ms, turn p50 {each[len(each) // 2] * 1e3:.0f} ms, "
              f"max {each[-1] * 1e3:.0f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=None, help="a model folder with the tokenizer (default: the embedded model)")
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--system-len", type=int, default=SyntheticShape.system_len, help="system prompt tokens")
    p.add_argument("--turns", type=int, default=SyntheticShape.turns, help="the wave sends each conversation's last")
    p.add_argument("--processes", default="1,2,4,8")
    p.add_argument("--waves", type=int, default=3, help="waves a helper count (the fastest is kept)")
    args = p.parse_args(argv)
    rows = asyncio.run(run(args))
    print(f"\n{os.cpu_count()} CPUs, {args.conversations} conversations at once, {rows[0][4]} prompt tokens each")
    print("| template helpers | wave ms | turn p50 ms | turn max ms |")
    print("|---|---|---|---|")
    for processes, wall, p50, worst, _ in rows:
        print(f"| {processes} | {wall * 1e3:.0f} | {p50 * 1e3:.0f} | {worst * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
