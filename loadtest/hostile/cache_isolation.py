"""Can one tenant learn another's prompt from the prefix cache? Two API keys, one stack.

    python -m loadtest.hostile.cache_isolation --base-url http://127.0.0.1:8000/v1 \
        --victim-key sk-a --attacker-key sk-b [--trials 20] [--words 400] [--json F]

Each trial: the victim A sends a note (a system message opening with a fresh 4-digit PIN, then
--words random words); the attacker B sends the same note (a right guess) and the note with
another PIN (a wrong guess), in turn first; then A repeats its note (the control). PINs sit in
the first page and never repeat, so whatever B finds cached came from A. PASS (else exit 1): B
finds 0 `cached_tokens` for either guess, the two TTFT ranges overlap, A's repeats are cached."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from loadtest.config import EndpointConfig
from loadtest.endpoint import api_base, discover_model
from loadtest.records import RequestRecord
from loadtest.sse_client import PreparedRequest, build_body, make_client, send_streaming

WORDS = ("amber harbor quiet lantern meadow copper river ledger orchard pebble signal timber velvet window canyon "
         "falcon garden island jacket kettle lemon marble nickel olive parcel quartz ribbon saddle tunnel umbrella "
         "violet walnut yarrow zephyr anchor bridge candle dolphin ember fabric glacier hollow ivory juniper kernel "
         "lagoon mirror nectar onion pepper").split()


@dataclass
class Answer:
    cached_tokens: int
    prompt_tokens: int
    ttft_s: float


@dataclass
class Trial:
    right: Answer  # B sends A's exact note
    wrong: Answer  # B sends the note with another PIN
    victim_repeat: Answer  # A sends its note again


@dataclass
class ProbeResult:
    trials: list[Trial] = field(default_factory=list)

    right_cached = property(lambda self: [t.right.cached_tokens for t in self.trials])
    wrong_cached = property(lambda self: [t.wrong.cached_tokens for t in self.trials])

    @property
    def victim_hit_rate(self) -> float:
        cached = sum(t.victim_repeat.cached_tokens for t in self.trials)
        return cached / max(1, sum(t.victim_repeat.prompt_tokens for t in self.trials))

    def ttft_range(self, which: str) -> tuple[float, float]:
        times = [getattr(t, which).ttft_s for t in self.trials]
        return min(times), max(times)

    @property
    def ttft_overlap(self) -> bool:
        (r_lo, r_hi), (w_lo, w_hi) = self.ttft_range("right"), self.ttft_range("wrong")
        return max(r_lo, w_lo) <= min(r_hi, w_hi)

    @property
    def passed(self) -> bool:
        return (bool(self.trials) and not any(self.right_cached) and not any(self.wrong_cached)
                and self.ttft_overlap and self.victim_hit_rate > 0)

    def summary(self) -> str:
        (r_lo, r_hi), (w_lo, w_hi) = self.ttft_range("right"), self.ttft_range("wrong")
        return "\n".join([
            f"trials                        {len(self.trials)}",
            f"B cached tokens, right guess  {self.right_cached}",
            f"B cached tokens, wrong guess  {self.wrong_cached}",
            f"B TTFT, right guess           {r_lo:.3f} .. {r_hi:.3f} s",
            f"B TTFT, wrong guess           {w_lo:.3f} .. {w_hi:.3f} s",
            f"TTFT ranges overlap           {'yes' if self.ttft_overlap else 'no'}",
            f"A's own repeat, cached share  {self.victim_hit_rate:.1%} "
            f"({[t.victim_repeat.cached_tokens for t in self.trials]} tokens)",
            f"verdict                       {'PASS' if self.passed else 'FAIL'}",
        ])


def note(pin: int, words: list[str]) -> list[dict]:
    return [{"role": "system", "content": f"My bank PIN is {pin}. Keep this note for my records."},
            {"role": "user", "content": " ".join(words)}]


async def _probe(base: str, keys: tuple[str, str], trials: int, words: int, rng: random.Random,
                 model: str | None, timeout_s: float) -> ProbeResult:
    endpoints = [EndpointConfig(base, api_key=key, model=model, timeout_s=timeout_s, ignore_eos="off") for key in keys]
    model = model or discover_model(base, endpoints[0].http_headers)
    result = ProbeResult()
    async with make_client(endpoints[0], 1) as victim, make_client(endpoints[1], 1) as attacker:

        async def ask(http, messages: list[dict]) -> Answer:
            """One streamed chat completion: the usage it reports and its first token's time."""
            rec = RequestRecord(0, 0.0, 0, 2)
            prepared = PreparedRequest(build_body(endpoints[0], model, messages, None, 2), 0, 2)
            await send_streaming(http, base + "/chat/completions", endpoints[0], prepared, rec, time.monotonic)
            if not rec.ok or rec.usage_prompt_tokens is None:
                raise RuntimeError(f"{rec.error_kind or 'no usage in the stream'}: {rec.error_detail}")
            return Answer(rec.usage_cached_tokens or 0, rec.usage_prompt_tokens, rec.ttft)

        pins = rng.sample(range(1000, 10000), 2 * trials)  # no two prompts of the run share a first page
        for i in range(trials):
            filler = [rng.choice(WORDS) for _ in range(words)]
            secret, guess = note(pins[2 * i], filler), note(pins[2 * i + 1], filler)
            await ask(victim, secret)  # A's note is in A's cache now
            got = {which: await ask(attacker, messages)  # which goes first alternates
                   for which, messages in [("right", secret), ("wrong", guess)][::1 if i % 2 == 0 else -1]}
            result.trials.append(Trial(got["right"], got["wrong"], await ask(victim, secret)))
    return result


def run_probe(base_url: str, victim_key: str, attacker_key: str, trials: int = 20, words: int = 400,
              seed: int | None = None, model: str | None = None, timeout_s: float = 120.0) -> ProbeResult:
    rng = random.Random(seed if seed is not None else time.time_ns())
    return asyncio.run(_probe(api_base(base_url), (victim_key, attacker_key), trials, words, rng, model, timeout_s))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.hostile.cache_isolation",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the gateway's OpenAI base URL (.../v1)")
    p.add_argument("--victim-key", required=True, help="tenant A's API key")
    p.add_argument("--attacker-key", required=True, help="tenant B's API key (another tenant)")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--words", type=int, default=400, help="filler words in each note (its length)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default=None, help="write every trial's readings here")
    args = p.parse_args(argv)
    result = run_probe(args.base_url, args.victim_key, args.attacker_key, args.trials, args.words, args.seed)
    print(result.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trials": [asdict(t) for t in result.trials], "ttft_overlap": result.ttft_overlap,
                       "passed": result.passed}, f, indent=1)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
