"""Tenant isolation of the prefix cache, end to end: `duet up` with two API keys, split (a
prefill and a decode worker, KV over NIXL) and colocated (one `both` worker), real processes
on the CPU, the official openai client.

- Tenant B sending tenant A's conversation finds nothing cached (also with a `cache_salt`),
  while A's own later turns are served from the cache (the hit rate is in the message).
- `cache_salt` is honoured: one key with one salt shares, with another salt (or none) it does
  not, another key with the same salt does not; an operator's shared salt
  (DUET_SHARED_CACHE_SALTS) shares across keys.
- Redis's page sets hold salted hashes only: the plain chained hashes of A's prompt are in no
  worker's set, the ones seeded with A's namespace (keyed by the file `duet up` gave the
  gateway) are.
- The cross-tenant probe (loadtest/hostile/cache_isolation.py), briefly: B's cached tokens are 0
  for a right and a wrong guess of A's PIN (timing is the probe's measurement, not asserted).
"""
from __future__ import annotations

import psutil
import pytest

from loadtest.hostile.cache_isolation import run_probe
from services.gateway.http_edge.auth import tenant_name
from services.gateway.http_edge.cache_namespace import CacheNamespaces
from shared.registry.prefix_hashes import chained_page_hashes
from tests.helpers.stack import PREFIX, DuetUp, managed, model_dir, new_log_dir, wait_until

pytestmark = pytest.mark.slow

KEY_A = "sk-tenant-a-5d1e08c2f4"
KEY_B = "sk-tenant-b-93a7c6e1b0"
SHARED_SALT = "northwind-public-prompt"
PAGE = 16
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are the support assistant of Northwind Tea, which imports green, black and oolong teas from "
          "family farms in Japan, India and Taiwan. Orders ship from Rotterdam on weekdays and take three to "
          "five days inside the European Union; shipping is free above forty euros. Unopened tins may be "
          "returned within thirty days. Answer briefly and politely.")
QUESTIONS = ["How long does shipping take to Germany?", "Is it free for an order of fifty euros?",
             "Can I return a tin I opened?", "Which teas come from Taiwan?"]
MODES = {"split": ("--prefill", "1", "--decode", "1"),
         "colocated": ("--both", "1", "--prefill", "0", "--decode", "0")}


@pytest.fixture(scope="module", params=list(MODES))
def stack(request):
    up = DuetUp(new_log_dir(f"cache-isolation-{request.param}"), "--api-key", KEY_A, "--api-key", KEY_B,
                *MODES[request.param], kv_cache_memory="128M", env={"DUET_SHARED_CACHE_SALTS": SHARED_SALT})
    with managed(request, up.start()) as s:
        s.wait_ready()
        # `duet up` is ready once a worker serves; a turn served before the prefill worker joined
        # leaves no pages there, which the next turn's split placement would then find missing
        workers = 2 if request.param == "split" else 1
        wait_until(lambda: len(s.workers()) >= workers, 120, f"{workers} worker(s) in the registry")
        yield s


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir()))


def client(stack, key: str):
    import openai
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=120)


def ask(c, messages, salt: str | None = None):
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                  extra_body={"cache_salt": salt} if salt is not None else None)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


def test_another_tenant_finds_nothing_of_a_conversation_and_its_owner_keeps_its_reuse(stack):
    a, b = client(stack, KEY_A), client(stack, KEY_B)
    messages, turns = [{"role": "system", "content": SYSTEM}], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        text, cached, prompt = ask(a, messages)
        messages.append({"role": "assistant", "content": text})
        turns.append((cached, prompt))
    later = turns[1:]
    hit_rate = sum(c for c, _ in later) / sum(p for _, p in later)
    report = f"A's turns (cached, prompt tokens): {turns}; turns 2+ hit rate {hit_rate:.0%}"
    print(f"\n[{stack.log_dir.name}] {report}")
    assert turns[0][0] == 0 and all(c > 0 for c, _ in later) and hit_rate > 0.6, report
    # B sends A's whole conversation, then A's first turn with a salt of its own: nothing cached
    assert ask(b, messages[:-1])[1] == 0
    assert ask(b, messages[:2], salt="b-own-salt")[1] == 0
    # and A's next turn is still served from A's cache
    messages.append({"role": "user", "content": "Thank you!"})
    _, cached, prompt = ask(a, messages)
    assert cached >= turns[-1][1] - PAGE, (cached, prompt, report)


def test_cache_salt_is_honoured(stack):
    a, b = client(stack, KEY_A), client(stack, KEY_B)
    note = [{"role": "system", "content": "Salted session notes: the blue folder is in the second drawer of "
                                          "the oak desk, next to the window in the reading room."},
            {"role": "user", "content": "Where is the blue folder?"}]
    assert ask(a, note, salt="alice-1")[1] == 0
    assert ask(a, note, salt="alice-1")[1] > 0  # same key, same salt: shared
    assert ask(a, note, salt="alice-2")[1] == 0  # same key, another salt: not
    assert ask(a, note)[1] == 0  # no salt is a namespace of its own too
    assert ask(b, note, salt="alice-1")[1] == 0  # another key with A's salt: not
    public = [{"role": "system", "content": "Public notice: the library opens at nine and closes at six on "
                                            "weekdays, and at noon on Saturdays; it is closed on Sundays."},
              {"role": "user", "content": "When does the library open?"}]
    assert ask(a, public, salt=SHARED_SALT)[1] == 0
    assert ask(b, public, salt=SHARED_SALT)[1] > 0  # the operator's shared salt: shared across keys
    assert ask(b, public)[1] == 0  # without it, B's own namespace


def test_redis_holds_salted_page_hashes_only(stack, tokenizer):
    a = client(stack, KEY_A)
    messages = [{"role": "system", "content": "Registry check: " + SYSTEM}, {"role": "user", "content": "Hello"}]
    _, _, prompt_tokens = ask(a, messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == prompt_tokens
    key_file = psutil.Process(stack.gateway_pid()).environ()["DUET_CACHE_NAMESPACE_KEY_FILE"]  # from duet up
    with open(key_file) as f:
        namespace = CacheNamespaces.from_secret(f.read().strip()).scope(tenant_name(KEY_A.encode()), None).namespace
    salted, plain = chained_page_hashes(ids, PAGE, seed=namespace), chained_page_hashes(ids, PAGE)
    r = stack.redis()

    def published() -> set[int]:
        held = set()
        for key in r.scan_iter(f"{PREFIX}:worker:*:pages"):
            held |= {int(h) for h in r.smembers(key)}
        return held
    wait_until(lambda: set(salted) <= published(), 10, "A's salted page hashes in the registry")
    assert not set(plain) & published(), "an unsalted page hash of A's prompt is in the registry"


def test_the_cache_probe_finds_nothing_of_the_other_tenant(stack):
    result = run_probe(stack.base_url, KEY_A, KEY_B, trials=3, words=120, seed=7)
    assert result.right_cached == [0, 0, 0] and result.wrong_cached == [0, 0, 0], result.summary()
    assert result.victim_hit_rate > 0.5, result.summary()
