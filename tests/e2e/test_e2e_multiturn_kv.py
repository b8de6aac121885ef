"""KV that outlives the request, end to end through real processes: redis, the router,
prefill and decode workers over gRPC, KV moved by NIXL, the gateway, the official openai
client.

A scripted chat (a long system prompt, short user turns, each answer fed back into the
next prompt) against:
- 1 prefill + 1 decode with local prefill off, so every turn goes through the prefill
  worker: decode keeps each turn's pages and the next turn moves only its tail; prefill's
  own cache serves most of the prompt. The decode worker killed between turns comes back
  empty; answers stay right and the turn after reuses again.
- 1 prefill + 1 decode with local prefill on (the default) and a decode device pool too
  small for two conversations, over a host tier: later turns are prefilled by the decode
  worker itself, from pages it loads back from host memory (a chat whose first turn left the
  device before its second came loses that one turn: the default write policy). Then 40 concurrent
  conversations; afterwards no page of any tier is unaccounted for.
Every answer equals the engine's with the prefix cache off (offline, same weights, fp32
greedy)."""
from __future__ import annotations

import asyncio

import pytest

from tests.helpers.stack import ProcessStack, managed, model_dir, new_log_dir, page_bytes, wait_until

MAX_TOKENS = 24
SYSTEM = (
    "You are the support assistant of Northwind Tea, a small company that imports green, black and "
    "oolong teas from family farms in Japan, India and Taiwan. Orders ship from Rotterdam on weekdays; "
    "shipping inside the European Union takes three to five days and is free above forty euros. "
    "Customers may return unopened tins within thirty days for a full refund; opened tins can be "
    "exchanged once. The loyalty programme gives one point per euro spent, and two hundred points "
    "buy a ten euro voucher. Brewing advice: green tea at seventy to eighty degrees for two minutes, "
    "black tea at ninety-five degrees for four minutes, oolong at ninety degrees for three minutes, "
    "and always with fresh, soft water. Answer briefly, politely and only about the company, its teas "
    "and its orders. If you do not know an answer, say so and offer to put the customer in touch "
    "with a person on the team, who answers emails within one working day."
)
QUESTIONS = [
    "How long does shipping take to Germany?",
    "And is it free for an order of fifty euros?",
    "How should I brew the oolong?",
    "Can I return a tin I already opened?",
    "How many points do I need for a voucher?",
    "Thanks! What teas come from Taiwan?",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir()))


@pytest.fixture(scope="module")
def reference(tokenizer):
    """The chat's answers from the offline engine with the prefix cache off."""
    from shared.engine import LLM, SamplingParams
    llm = LLM(str(model_dir()), kv_cache_memory=64 << 20, enable_prefix_cache=False)
    messages, answers = [{"role": "system", "content": SYSTEM}], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
        answers.append(out.text)
        messages.append({"role": "assistant", "content": out.text})
    return answers


class Chat:
    """One conversation through the gateway, answers fed back."""

    def __init__(self, client, system: str = SYSTEM):
        self.client = client
        self.messages = [{"role": "system", "content": system}]

    def turn(self, question: str):
        self.messages.append({"role": "user", "content": question})
        r = self.client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=self.messages,
                                                max_tokens=MAX_TOKENS, temperature=0)
        text = r.choices[0].message.content
        self.messages.append({"role": "assistant", "content": text})
        return text, r.usage


def sent_bytes(stack, worker: str) -> float:
    return stack.metrics(worker).value("duet_kv_transfer_bytes_total", direction="sent")


def admission_cached_tokens(stack) -> float:
    return stack.gateway_metrics().value("duet_gateway_admission_cached_prompt_tokens_total")


def admission_local_prefill_tokens(stack) -> float:
    return stack.gateway_metrics().value("duet_gateway_admission_local_prefill_prompt_tokens_total")


def assert_no_page_unaccounted(stack, workers) -> None:
    stack.wait_idle(workers)
    for w in workers:
        m = stack.metrics(w)
        for tier in ("device", "host"):
            assert m.value("duet_kv_unaccounted_pages", tier=tier) == 0, (w, tier)
        assert m.has("duet_kv_unaccounted_pages"), f"{w} never read its accounting while idle"


# -- every turn through prefill: delta transfers, a decode restart ------------------------------
@pytest.fixture(scope="module")
def split_stack(request):
    s = ProcessStack(new_log_dir("multiturn-split"), registry_ttl_s=3.0, kv_cache_memory="96M")
    with managed(request, s):
        s.start_redis()
        s.start_router(extra=["--local-prefill-max-tokens", "0"])
        s.add_worker("prefill", "prefill-0")
        s.add_worker("decode", "decode-0")
        s.start_gateway()
        s.wait_ready()
        yield s


def test_split_turns_move_only_the_tail_and_survive_a_decode_restart(split_stack, reference):
    s = split_stack
    per_token = page_bytes(model_dir(), 1)
    chat = Chat(s.client())
    moved, cached, cached_tokens = [], [], 0
    uncharged_before = admission_cached_tokens(s)
    for i, question in enumerate(QUESTIONS[:4]):
        before = sent_bytes(s, "prefill-0")
        text, usage = chat.turn(question)
        assert text == reference[i], f"turn {i + 1}"
        moved.append((sent_bytes(s, "prefill-0") - before) / (usage.prompt_tokens * per_token))
        cached.append(usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens)
        cached_tokens += usage.prompt_tokens_details.cached_tokens
    # what the routes expected cached left the gateway's prefill budget before the first token
    # (the prefill worker's page sets, published a moment after each turn: at least most of it)
    uncharged = admission_cached_tokens(s) - uncharged_before
    assert 0.5 * cached_tokens <= uncharged <= cached_tokens, (uncharged, cached_tokens)
    assert moved[0] > 0.95, moved  # nothing held anywhere at turn 1
    assert moved[3] <= 0.30, f"turn 4 moved {moved[3]:.0%} of its prompt's KV ({moved})"
    assert cached[3] >= 0.80, f"turn 4 cached {cached[3]:.0%} ({cached})"
    assert s.metrics("decode-0").value("duet_kv_cache_hit_tokens_total", tier="device") > 0

    # the decode worker dies between turns and comes back with an empty cache
    old = s.workers()["decode-0"]["instance_nonce"]
    s.kill("decode-0")
    s.add_worker("decode", "decode-0")
    wait_until(lambda: s.workers().get("decode-0", {}).get("instance_nonce") not in (None, old), 240,
               "the restarted decode worker in the registry")
    assert s.metrics("decode-0").value("duet_kv_cache_hit_tokens_total", tier="device") == 0
    for i in (4, 5):
        before = sent_bytes(s, "prefill-0")
        text, usage = chat.turn(QUESTIONS[i])
        assert text == reference[i], f"turn {i + 1} after the restart"
        moved.append((sent_bytes(s, "prefill-0") - before) / (usage.prompt_tokens * per_token))
    assert moved[4] > 0.95, "the restarted decode worker cannot hold anything yet"
    assert moved[5] <= 0.30, f"the cache is rebuilt: turn 6 moved {moved[5]:.0%}"
    assert_no_page_unaccounted(s, ["prefill-0", "decode-0"])


# -- decode prefills the rest itself, from its host tier; 40 conversations -----------------------
@pytest.fixture(scope="module")
def tiered_stack(request):
    s = ProcessStack(new_log_dir("multiturn-tiers"), registry_ttl_s=3.0, kv_cache_memory="96M")
    with managed(request, s):
        s.start_redis()
        # the threshold rule: a later turn always prefills on decode, the subject here is the
        # host tier it loads back from (the predicted choice, from step models timed on a busy
        # 2-core machine, is tests/e2e/test_e2e_placement.py's)
        s.start_router(extra=["--placement", "threshold"])
        s.add_worker("prefill", "prefill-0")
        # ~29 pages of 16 tokens on the device: one chat at a time; 512 MiB of host tier. The
        # 40 conversations queue for room (a burst, not an overload): a long reserve deadline
        # keeps a slow 2-core CI machine from turning the wait into 429s
        s.add_worker("decode", "decode-0", extra=["--kv-cache-memory", "22M", "--kv-host-memory", "512M",
                                                   "--reserve-timeout", "300"])
        s.start_gateway()
        s.wait_ready()
        yield s


def test_decode_prefills_later_turns_from_pages_it_loads_back(tiered_stack, reference):
    s = tiered_stack
    a, b = Chat(s.client()), Chat(s.client(), system=SYSTEM.replace("Northwind", "Southwind"))
    local_before = s.router_decisions("local_prefill")
    off_budget_before = admission_local_prefill_tokens(s)
    for i, question in enumerate(QUESTIONS[:4]):
        text, usage = a.turn(question)
        assert text == reference[i], f"turn {i + 1}"
        b.turn(question)  # the other chat pushes this one's pages off the device pool
        if i == 3:
            assert usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens >= 0.80
    m = s.metrics("decode-0")
    assert m.value("duet_kv_cache_hit_tokens_total", tier="host") > 0, "nothing came back from the host tier"
    assert m.value("duet_kv_tier_copy_bytes_total", direction="offload") > 0
    # turns 2-4 of the first chat stay on decode, and 3-4 of the second: its first turn left the
    # device before its second came, and the default write policy keeps a turn once a later one
    # extended it (the second turn's own pages are kept: a conversation, kv_write_policy.py)
    assert s.router_decisions("local_prefill") - local_before >= 5, "later turns stay on decode"
    # the route's local_prefill reached the gateway's admission: what decode prefilled left its budget
    assert admission_local_prefill_tokens(s) > off_budget_before
    m = s.metrics("decode-0")
    assert m.value("duet_kv_host_writeback_pages_total", decision="written", reason="conversation") > 0
    assert m.value("duet_kv_host_writeback_pages_total", decision="dropped", reason="not_reused") > 0


def test_forty_concurrent_conversations_leave_no_page_behind(tiered_stack):
    s = tiered_stack

    async def conversation(client, k: int):
        messages = [{"role": "system", "content": f"You are assistant number {k}. Answer in a few words."}]
        for question in ("Hello, who are you?", "What is two plus two?"):
            messages.append({"role": "user", "content": question})
            r = await client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                     max_tokens=4, temperature=0)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})

    async def run():
        client = s.async_client(timeout=600.0)
        try:
            await asyncio.gather(*(conversation(client, k) for k in range(40)))
        finally:
            await client.close()
    asyncio.run(run())
    assert_no_page_unaccounted(s, ["prefill-0", "decode-0"])
