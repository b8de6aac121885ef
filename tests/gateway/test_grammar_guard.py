"""A request's grammar within the server's limits (shared/engine/grammar_limits.py,
grammar_guard.py): sizes and repetition counts are refused before any compile; the rest
compiles in a real helper process with a hard time budget, and a schema past it is refused
with a message that says why, while the event loop stays free. Verdicts are remembered;
a worker's guard ships a slow compile's result back, loadable with its own vocabulary."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from shared.engine.grammar_guard import GrammarGuard
from shared.engine.grammar_limits import GrammarLimits, check_size, largest_repeat
from shared.engine.grammar_spec import GrammarError, GrammarSpec
from tests.helpers.gateway_support import byte_level_tokenizer_dir

pytestmark = pytest.mark.timeout(300)

GOOD = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                              "required": ["n"]}))
# xgrammar's regex conversion is quadratic in the count (seconds here whatever the vocabulary)
SLOW = GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "[a-z]{1,12000}"}))


def schema(pattern: str) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "s": {"type": "string", "pattern": pattern}}}))


@pytest.mark.parametrize("pattern,count", [
    ("[a-z]{1,15000}", 15000), ("a{3}b{2,}", 3), (r"\{1,99999\}", 0), ("[{1,99999}]", 0),
    ("(ab){2,40}-x{7}", 40), ("no quantifier", 0), ("a{1,2,3}", 0), ("x{" + "9" * 5000 + "}", 1 << 62),
])
def test_largest_repeat_reads_counts_outside_escapes_and_classes(pattern, count):
    assert largest_repeat(pattern) == count


def test_size_limits_name_the_problem():
    limits = GrammarLimits(max_bytes=200, max_repeat=1000)
    check_size(schema("[a-z]{1,1000}"), limits)
    with pytest.raises(GrammarError, match="repeats a pattern element 15000 times.*at most 1000"):
        check_size(schema("[a-z]{1,15000}"), limits)
    with pytest.raises(GrammarError, match="repeats"):  # patternProperties keys are regexes too
        check_size(GrammarSpec("json_schema", json.dumps({"type": "object", "patternProperties": {
            "^k{1,5000}$": {"type": "string"}}})), limits)
    with pytest.raises(GrammarError, match="repeats"):
        check_size(GrammarSpec("regex", "a{2000}"), limits)
    with pytest.raises(GrammarError, match="bytes; this server compiles at most 200"):
        check_size(GrammarSpec("json_schema", json.dumps({"enum": ["x" * 300]})), limits)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def guard(tokenizer):
    g = GrammarGuard.for_tokenizer(GrammarLimits(timeout_s=1.5, max_repeat=100_000), tokenizer)
    yield g
    g.close()


def test_guard_passes_good_grammars_and_names_bad_ones(guard):
    async def scenario():
        assert await guard.check(GOOD) is None  # the gateway's guard never ships
        assert await guard.check(GrammarSpec("json_object")) is None
        with pytest.raises(GrammarError, match="minimum greater than maximum"):
            await guard.check(GrammarSpec("json_schema", json.dumps(
                {"type": "integer", "minimum": 5, "maximum": 1})))
        started = time.monotonic()
        with pytest.raises(GrammarError, match="repeats a pattern element"):
            await guard.check(schema("[a-z]{1,150000}"))
        assert time.monotonic() - started < 0.5  # no compile needed to tell
    asyncio.run(scenario())


def test_a_compile_past_the_budget_is_refused_in_time_and_the_loop_stays_free(guard):
    async def scenario():
        await guard.check(GOOD)  # the helper is up
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
        tick = asyncio.create_task(ticker())
        started = time.monotonic()
        with pytest.raises(GrammarError, match=r"takes longer than this server allows \(1.5s\)"):
            await guard.check(SLOW)
        took = time.monotonic() - started
        stop.set()
        await tick
        started = time.monotonic()
        with pytest.raises(GrammarError, match="takes longer"):  # remembered: no second compile
            await guard.check(SLOW)
        return took, max(gaps), time.monotonic() - started

    took, worst_gap, again = asyncio.run(scenario())
    assert 1.4 < took < 5, took
    assert worst_gap < 0.25, worst_gap
    assert again < 0.1, again
    assert guard.pool.stats.timeouts >= 1


def test_a_workers_guard_ships_a_slow_compile_that_its_backend_adopts(tokenizer):
    from shared.engine.grammar import GrammarBackend
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    guard = GrammarGuard.for_tokenizer_info(GrammarLimits(timeout_s=60, max_repeat=10_000),
                                            backend.info.serialize_json)
    slow = GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "[a-z]{1,2500}"}))
    try:
        shipped = asyncio.run(guard.check(slow))
        assert shipped is not None  # slower than SHIP_AFTER_S here: sent back, not compiled twice
        backend.adopt(slow, shipped)
        assert backend.cached(slow) and backend.compiles == 0
        state = backend.new_state(slow)
        assert state.accept(tokenizer.encode('"', add_special_tokens=False)[0])
        assert asyncio.run(guard.check(GOOD)) is None  # a quick one: compiled again by its user
    finally:
        guard.close()
