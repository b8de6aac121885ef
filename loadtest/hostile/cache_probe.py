"""Can one tenant learn another's prompt from the prefix cache? Two API keys, one stack.

    python -m loadtest.hostile.cache_probe --base-url http://127.0.0.1:8000/v1 \
        --victim-key sk-a --attacker-key sk-b [--trials 20] [--words 400] [--json F]

Each trial: the victim (A) sends a note (a system message opening with a fresh 4-digit PIN,
then --words fresh words); the attacker (B, the other key) then sends the same note, a right
guess, and the note with another PIN, a wrong guess (which goes first alternates); then A
sends its note again (its own reuse, the control). Every PIN of a run is different and sits in
the prompt's first page, so B never sent anything sharing a page with either guess: whatever
B finds cached came from A. Recorded for each: `usage.prompt_tokens_details.cached_tokens`
and the time to its first streamed token. Printed: B's cached tokens for right and wrong
guesses, the TTFT range of each, whether the two ranges overlap, and A's own reuse.

Verdict PASS: B's cached tokens for a right guess are 0 every trial, as for a wrong one, and
the TTFT ranges overlap (a right guess is indistinguishable by time); A's repeats are
cached. A leaking cache shows up as cached tokens for the right guess and a faster right
guess. Exit status 1 on FAIL."""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

WORDS = ("amber harbor quiet lantern meadow copper river ledger orchard pebble signal timber velvet "
         "window canyon falcon garden island jacket kettle lemon marble nickel olive parcel quartz "
         "ribbon saddle tunnel umbrella violet walnut yarrow zephyr anchor bridge candle dolphin "
         "ember fabric glacier hollow ivory juniper kernel lagoon mirror nectar onion pepper").split()


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

    @property
    def right_cached(self) -> list[int]:
        return [t.right.cached_tokens for t in self.trials]

    @property
    def wrong_cached(self) -> list[int]:
        return [t.wrong.cached_tokens for t in self.trials]

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


def ask(client, model: str, messages: list[dict]) -> Answer:
    """One streamed chat completion: its first token's time and the usage it reports."""
    t0 = time.monotonic()
    ttft, usage = None, None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content is not None:
            ttft = time.monotonic() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    details = usage.prompt_tokens_details
    return Answer(details.cached_tokens if details is not None and details.cached_tokens else 0,
                  usage.prompt_tokens, ttft if ttft is not None else time.monotonic() - t0)


def run_probe(base_url: str, victim_key: str, attacker_key: str, trials: int = 20, words: int = 400,
              seed: int | None = None, model: str | None = None, timeout_s: float = 120.0) -> ProbeResult:
    import openai

    victim = openai.OpenAI(base_url=base_url, api_key=victim_key, max_retries=0, timeout=timeout_s)
    attacker = openai.OpenAI(base_url=base_url, api_key=attacker_key, max_retries=0, timeout=timeout_s)
    model = model or victim.models.list().data[0].id
    rng = random.Random(seed if seed is not None else time.time_ns())
    result = ProbeResult()
    pins = rng.sample(range(1000, 10000), 2 * trials)  # no two prompts of the run share a first page
    for i in range(trials):
        filler = [rng.choice(WORDS) for _ in range(words)]
        secret, guess = note(pins[2 * i], filler), note(pins[2 * i + 1], filler)
        ask(victim, model, secret)  # A's note is in A's cache now
        if i % 2 == 0:
            right = ask(attacker, model, secret)
            wrong = ask(attacker, model, guess)
        else:
            wrong = ask(attacker, model, guess)
            right = ask(attacker, model, secret)
        result.trials.append(Trial(right, wrong, ask(victim, model, secret)))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.hostile.cache_probe", description=__doc__.split("\n\n")[0])
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
