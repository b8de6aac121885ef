"""The one admission rule (shared/admission): the KV demand of a request with n sequences,
the context rule's OpenAI message, the "can never fit any live worker" check the gateway
makes. The sampling type's way over gRPC is tests/disagg/test_wire_roundtrip.py."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from services.gateway.backends.capacity import (WorkerCapacity, batch_capacity, check_fits_some_worker,
                                                prefill_capacity)
from services.router.policy import pages_needed
from shared.admission.context_rule import completion_budget
from shared.admission.kv_demand import check_fits, kv_demand
from shared.openai_protocol.errors import InvalidRequest


# --- KV demand ---------------------------------------------------------------------------

def test_one_sequence_needs_the_pages_of_prompt_plus_completion():
    for prompt, max_tokens, page in [(1, 1, 16), (20, 13, 4), (16, 16, 16), (15, 1, 16), (100, 0, 7)]:
        d = kv_demand(prompt, max_tokens, 1, page)
        assert d.pages == math.ceil((prompt + max_tokens) / page), (prompt, max_tokens, page)
        assert d.tokens == prompt + max_tokens


def test_n_sequences_share_the_full_prompt_pages_and_each_copies_the_last():
    d = kv_demand(20, 13, 3, 4)  # 5 full prompt pages; each sequence: pages 5..8 (4)
    assert (d.shared_pages, d.pages_per_sequence, d.pages, d.tokens) == (5, 4, 17, 20 + 3 * 13)
    aligned = kv_demand(16, 1, 4, 16)  # the prompt fills its page: each sequence starts a new one
    assert (aligned.shared_pages, aligned.pages_per_sequence, aligned.pages) == (1, 1, 5)
    short = kv_demand(3, 2, 8, 16)  # no full page: each sequence copies the partial one
    assert (short.shared_pages, short.pages) == (0, 8)
    # never more than n whole copies, never less than one
    for prompt, max_tokens, n, page in [(37, 50, 5, 16), (64, 1, 128, 16), (5, 300, 2, 4)]:
        d = kv_demand(prompt, max_tokens, n, page)
        one = kv_demand(prompt, max_tokens, 1, page).pages
        assert one <= d.pages <= n * one


def test_the_router_sizes_decode_by_the_same_rule_with_n():
    assert pages_needed(20, 13, 4, n=3) == kv_demand(20, 13, 3, 4).pages == 17
    assert pages_needed(20, 13, 4) == 9
    assert pages_needed(20, 13, 0) == 0  # unknown page size: no opinion


def test_check_fits_names_tokens_pages_and_the_param():
    check_fits(kv_demand(20, 12, 1, 4), 8)  # exactly fits
    with pytest.raises(InvalidRequest) as info:
        check_fits(kv_demand(20, 13, 1, 4), 8)
    assert "needs 33 tokens of KV; this worker holds 32" in info.value.message
    assert (info.value.param, info.value.code, info.value.status) == ("max_tokens", "kv_capacity_exceeded", 400)
    with pytest.raises(InvalidRequest, match="Lower max_tokens and n"):
        check_fits(kv_demand(20, 13, 2, 4), 12)


def test_context_rule_in_openai_words():
    assert completion_budget(None, None, 10, 100) == 90  # the rest of the context
    assert completion_budget(None, 16, 95, 100) == 5  # the default, capped by the room left
    assert completion_budget(90, None, 10, 100) == 90
    with pytest.raises(InvalidRequest) as info:
        completion_budget(91, None, 10, 100, "messages")
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    assert ("maximum context length is 100 tokens. However, you requested 101 tokens (10 in the messages, "
            "91 in the completion)") in info.value.message
    with pytest.raises(InvalidRequest, match="leaves no room"):
        completion_budget(None, None, 100, 100)


def test_can_never_fit_any_live_worker():
    both = [WorkerCapacity("both", 90, 16, 256)]
    check_fits_some_worker(both, 100, 1000, 1)  # 69 pages
    with pytest.raises(InvalidRequest) as info:
        check_fits_some_worker(both, 10, 2048, 128)
    assert info.value.code == "kv_capacity_exceeded" and "largest both worker" in info.value.message
    split = [WorkerCapacity("prefill", 50, 16, 256), WorkerCapacity("decode", 30, 16, 8),
             WorkerCapacity("decode", 200, 16, 8)]
    check_fits_some_worker(split, 100, 2000, 1)  # fits the larger decode worker
    with pytest.raises(InvalidRequest, match="holds 3200"):  # the largest one's answer
        check_fits_some_worker(split, 100, 3200, 1, "max_completion_tokens")
    with pytest.raises(InvalidRequest) as info:  # decode could hold it, no prefill worker the prompt
        check_fits_some_worker(split, 1000, 10, 1)
    assert info.value.param == "prompt"
    check_fits_some_worker([], 10**6, 10**6, 128)  # nothing known: the workers judge
    assert batch_capacity(split) == 16 and batch_capacity(both) == 256
    assert batch_capacity([WorkerCapacity("decode", 1, 16, 0)]) == 0  # unknown
    prefills = [WorkerCapacity("prefill", 50, 16, 256, 1024), WorkerCapacity("prefill", 50, 16, 256, 2048),
                WorkerCapacity("decode", 30, 16, 8, 1024)]
    assert prefill_capacity(prefills) == 2 * (1024 + 2048)  # two steps of each prefilling worker
    assert prefill_capacity(split) == 0 and prefill_capacity([WorkerCapacity("both", 9, 16, 8, 512)]) == 1024


# --- no torch on the gateway's path -------------------------------------------------------

def test_the_sampling_type_and_the_rules_import_without_torch():
    code = ("import sys\n"
            "import shared.engine.sampling_params, shared.admission.kv_demand, shared.admission.context_rule\n"
            "import shared.wire.sampling, services.gateway.openai_api.request_sampling\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
