"""The wire module (shared/wire/) both ways: every engine object that crosses the gRPC
contract comes back equal after a trip through the message's bytes (sampling parameters,
step outputs with logprobs, finish reasons, prompt logprobs, usage, prefill's first tokens,
a reservation's pages and write capability, a request's cache scope), what the contract does not keep comes back as documented, and a
value the contract cannot carry is refused by its name, up to the gateway's backend."""
from __future__ import annotations

import asyncio
import copy
import subprocess
import sys

import grpc
import pytest

from protos import duet_pb2
from services.gateway.backends.grpc_workers import GrpcBackend, GrpcBackendConfig
from services.gateway.backends.interface import BackendBadRequest, GenerationRequest
from shared.engine.grammar_spec import GrammarSpec
from shared.engine.outputs import StepOutput
from shared.engine.sampling_params import SamplingParams
from shared.engine.cache_scope import DEFAULT_SCOPE, CacheScope
from shared.wire.cache_scope import cache_scope_fields, cache_scope_from_proto
from shared.wire.contract_overflow import ContractOverflow
from shared.wire.outputs import (PrefillAnswer, Usage, chunk_from_proto, chunk_to_proto, first_token_ids_from_proto,
                                 first_tokens_to_proto, prefill_reply_from_proto, prefill_reply_to_proto)
from shared.kv_transfer.capability import CapabilityIssuer, new_secret, refusal
from shared.wire.lease import (
    renew_reply_from_proto,
    renew_reply_to_proto,
    renew_request_from_proto,
    renew_request_to_proto,
)
from shared.wire.reservation import KvReservation, RankPages, reservation_from_proto, reservation_to_proto
from shared.wire.sampling import sampling_from_proto, sampling_to_proto
from shared.wire.stream_end import end_error, end_piece

RID = "req-1"
PROMPT = [101, 102, 103, 104]
# logprobs travel as float32: these are exact there
PROMPT_LOGPROBS = [None, (-1.5, [(102, -1.5), (7, -2.25)]), (-0.25, [(103, -0.25)]), (-3.0, [])]


def through_bytes(msg):
    """What the other side parses: the message's serialized bytes."""
    return type(msg).FromString(msg.SerializeToString())


# --- sampling parameters -------------------------------------------------------------------

def every_field_set(seed: int = -5) -> SamplingParams:
    return SamplingParams(temperature=0.5, top_p=0.75, top_k=40, min_p=0.125, seed=seed, max_tokens=77,
                          stop=["x", "yz"], stop_token_ids=[7, 8], ignore_eos=True, repetition_penalty=1.25,
                          frequency_penalty=0.5, presence_penalty=-0.5, logprobs=3, n=4,
                          logit_bias={50: -100.0, 2**31 - 1: 2.5}, grammar=GrammarSpec("regex", "[ab]+"),
                          prompt_logprobs=2)


def test_sampling_params_with_every_field_set_come_back_equal():
    params = every_field_set(seed=-5)
    msg = through_bytes(sampling_to_proto(params))
    assert msg.seed == (-5) % (1 << 64)  # two's complement: the engine's generator reads it the same
    expected = copy.deepcopy(params)
    expected.seed = (-5) % (1 << 64)
    assert sampling_from_proto(msg) == expected
    for seed in (0, 2**63 - 1, 2**64 - 1):  # a seed in uint64's range travels as it is
        assert sampling_from_proto(through_bytes(sampling_to_proto(every_field_set(seed)))) == every_field_set(seed)


@pytest.mark.parametrize("grammar", [GrammarSpec("json_object"), GrammarSpec("json_schema", '{"type": "integer"}'),
                                     GrammarSpec("ebnf", 'root ::= "a"')])
def test_every_grammar_kind_comes_back_equal(grammar):
    params = SamplingParams(grammar=grammar, temperature=0.0)
    assert sampling_from_proto(through_bytes(sampling_to_proto(params))) == params


def test_unset_sampling_fields_come_back_as_the_engine_defaults():
    for params in (SamplingParams(), SamplingParams(max_tokens=None, top_k=-1, temperature=0.0)):
        assert sampling_from_proto(through_bytes(sampling_to_proto(params))) == params
    off = sampling_from_proto(duet_pb2.SamplingParams())  # every field at its zero value
    assert (off.max_tokens, off.top_k, off.top_p, off.repetition_penalty, off.n, off.logprobs, off.seed,
            off.grammar, off.prompt_logprobs, off.logit_bias) == (None, -1, 1.0, 1.0, 1, None, None, None, None, None)


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**40), ("n", 2**31), ("max_tokens", 2**31), ("logprobs", 2**31), ("prompt_logprobs", 2**33),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("stop_token_ids", [2**31]), ("logit_bias", {2**40: 1.0}),
    ("logit_bias", {5: float("inf")}), ("repetition_penalty", 1e300), ("temperature", float("nan")),
    ("min_tokens", 3)])
def test_what_the_contract_cannot_carry_is_refused_by_name(field, value):
    params = SamplingParams()
    setattr(params, field, value)  # past SamplingParams' own checks: the wire module is the last line
    with pytest.raises(ContractOverflow) as info:
        sampling_to_proto(params)
    name = "top_logprobs" if field == "logprobs" else field
    assert info.value.field == name and str(info.value).startswith(name)


def test_the_grpc_backend_turns_a_refusal_into_a_bad_request_naming_the_param():
    async def generate_one():
        backend = GrpcBackend(GrpcBackendConfig(router_address="127.0.0.1:9"))  # never dialled
        await backend.start()
        try:
            sampling = SamplingParams(seed=2**64)
            async for _ in backend.generate(GenerationRequest(RID, PROMPT, sampling)):
                pass
        finally:
            await backend.close()

    with pytest.raises(BackendBadRequest) as info:
        asyncio.run(generate_one())
    assert info.value.param == "seed" and "seed must be between" in str(info.value)


def test_the_wire_module_imports_without_torch():
    code = ("import sys\n"
            "import shared.wire.sampling, shared.wire.outputs, shared.wire.reservation, shared.wire.cache_scope\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- step outputs --------------------------------------------------------------------------

def with_logprobs(**kw) -> StepOutput:
    return StepOutput(RID, [5, 6, 7], logprobs=[-0.5, -1.25, -2.0],
                      top_logprobs=[[(5, -0.5), (9, -1.5)], [(6, -1.25)], []], **kw)


@pytest.mark.parametrize("out,logprobs", [
    (with_logprobs(index=2), True),
    (StepOutput(RID, [5, 6]), False),
    (StepOutput(RID, [], finished=True, finish_reason="stop"), False),  # a finish with no new token
    (with_logprobs(prompt_logprobs=PROMPT_LOGPROBS), True),
])
def test_a_stream_chunk_comes_back_as_the_step_output(out, logprobs):
    back, usage = chunk_from_proto(through_bytes(chunk_to_proto(out, PROMPT)), RID, logprobs)
    assert back == out and usage is None


@pytest.mark.parametrize("reason", [None, "stop", "length", "abort"])
def test_every_finish_reason_comes_back(reason):
    out = StepOutput(RID, [9], finished=reason is not None, finish_reason=reason)
    back, _ = chunk_from_proto(through_bytes(chunk_to_proto(out, PROMPT)), RID, False)
    assert back == out


def test_an_engine_error_travels_as_abort():
    out = StepOutput(RID, [], finished=True, finish_reason="error", error="boom")
    back, _ = chunk_from_proto(through_bytes(chunk_to_proto(out, PROMPT)), RID, False)
    assert (back.finished, back.finish_reason) == (True, "abort")


def test_the_last_chunk_carries_the_usage_and_ends_the_request():
    out = with_logprobs(finished=True, finish_reason="length", request_finished=True, index=1)
    msg = through_bytes(chunk_to_proto(out, PROMPT, usage=Usage(4, 12, 2)))
    back, usage = chunk_from_proto(msg, RID, True)
    assert back == out and usage == Usage(prompt_tokens=4, completion_tokens=12, cached_tokens=2)


def test_several_outputs_of_a_sequence_go_in_one_chunk():
    from shared.wire.outputs import tokens_to_proto

    a, b = StepOutput(RID, [1, 2], logprobs=[-1.0, -2.0], top_logprobs=[[], []]), \
        StepOutput(RID, [3], logprobs=[-0.5], top_logprobs=[[(3, -0.5)]], finished=True, finish_reason="stop")
    back, _ = chunk_from_proto(through_bytes(chunk_to_proto(b, PROMPT, tokens_to_proto(a) + tokens_to_proto(b))),
                               RID, True)
    assert back == StepOutput(RID, [1, 2, 3], logprobs=[-1.0, -2.0, -0.5], top_logprobs=[[], [], [(3, -0.5)]],
                              finished=True, finish_reason="stop")


def test_what_the_contract_does_not_keep_comes_back_as_documented():
    # a None logprob arrives as 0.0; a one-token prompt has no prompt logprobs to send
    out = StepOutput(RID, [4], logprobs=[None], top_logprobs=[[]], prompt_logprobs=[None])
    back, _ = chunk_from_proto(through_bytes(chunk_to_proto(out, PROMPT[:1])), RID, True)
    assert (back.logprobs, back.prompt_logprobs) == ([0.0], None)


# --- prefill's first tokens ----------------------------------------------------------------

def firsts(n: int) -> list[StepOutput]:
    outs = [StepOutput(RID, [11 + i], logprobs=[-0.5 * (i + 1)], top_logprobs=[[(11 + i, -0.5 * (i + 1))]],
                       index=i) for i in range(n)]
    outs[0].prompt_logprobs = PROMPT_LOGPROBS
    if n > 1:
        outs[-1].finished, outs[-1].finish_reason = True, "stop"  # this sequence ends at its first token
    return outs


@pytest.mark.parametrize("n", [1, 3])
def test_prefills_answer_comes_back_equal(n):
    answer = PrefillAnswer(firsts(n), cached_tokens=8, computed_tokens=4, kv_bytes=4096)
    reply = through_bytes(prefill_reply_to_proto(answer, PROMPT))
    assert prefill_reply_from_proto(reply, RID, True) == answer
    # handed on to decode: every sequence's first token id, index order
    generate = duet_pb2.GenerateRequest(request_id=RID)
    first_tokens_to_proto(generate, answer.firsts)
    assert first_token_ids_from_proto(through_bytes(generate)) == [11 + i for i in range(n)]


def test_a_reply_without_sequences_is_one_sequence():
    reply = duet_pb2.PrefillReply(first_token=duet_pb2.Token(id=42), finish_reason=duet_pb2.FINISH_REASON_LENGTH,
                                  cached_tokens=1, computed_tokens=3)
    answer = prefill_reply_from_proto(reply, RID, False)
    assert answer == PrefillAnswer([StepOutput(RID, [42], finished=True, finish_reason="length")], 1, 3, 0)


# --- a reservation's pages -----------------------------------------------------------------

def test_a_reservation_comes_back_equal():
    res = KvReservation(reservation_id=2**64 - 1, generation=7, decode_worker_id="decode-0",
                        decode_instance_nonce="n1", page_size=16, num_layers=28, kv_dtype="bfloat16",
                        compat_hash="abc", ranks=[RankPages(0, "decode-0-r0", [3, 4, 9]),
                                                  RankPages(1, "decode-0-r1", [3, 4, 9])],
                        held_pages=2, held_page_hashes=[2**64 - 2, 5], lease_ttl_ms=10_000)
    assert reservation_from_proto(through_bytes(reservation_to_proto(res))) == res
    bare = KvReservation(1, 1, "d", "n", 4, 2, "float32", "h", ranks=[RankPages(0, "a", [0])])
    assert reservation_from_proto(through_bytes(reservation_to_proto(bare))) == bare


def test_the_leases_a_holder_renews_and_those_it_lost_come_back_in_order():
    keys = [(2**64 - 1, 7), (1, 1), (5, 2**32 - 1)]
    assert renew_request_from_proto(through_bytes(renew_request_to_proto(keys))) == keys
    assert renew_reply_from_proto(through_bytes(renew_reply_to_proto(keys[1:]))) == keys[1:]
    assert renew_reply_from_proto(through_bytes(renew_reply_to_proto([]))) == []


def test_a_write_capability_comes_back_and_still_verifies():
    """The signature covers the reservation as the wire module decodes it: what prefill reads
    verifies with the issuer's key; a page changed on the way, or another writer, does not."""
    issuer = CapabilityIssuer()
    res = KvReservation(reservation_id=9, generation=1, decode_worker_id="decode-0", decode_instance_nonce="n1",
                        page_size=16, num_layers=28, kv_dtype="bfloat16", compat_hash="abc",
                        ranks=[RankPages(0, "decode-0-r0", [3, 4, 9]), RankPages(1, "decode-0-r1", [3, 4, 9])],
                        held_pages=1, held_page_hashes=[2**64 - 2])
    res.capability = issuer.issue(res, "prefill-0", 120_000, new_secret())
    back = reservation_from_proto(through_bytes(reservation_to_proto(res)))
    assert back == res
    assert refusal(back, "prefill-0", issuer.public_key) == ("", "")
    assert refusal(back, "prefill-1", issuer.public_key)[0] == "writer"
    assert refusal(back, "prefill-0", CapabilityIssuer().public_key)[0] == "signature"  # another instance's key
    back.ranks[1].page_ids[2] = 10
    assert refusal(back, "prefill-0", issuer.public_key)[0] == "signature"


# --- a request's cache namespace, tenant and LoRA adapter ---------------------------------

@pytest.mark.parametrize("message", [duet_pb2.ReserveRequest, duet_pb2.PrefillRequest, duet_pb2.GenerateRequest])
@pytest.mark.parametrize("scope", [CacheScope(2**64 - 1, 3), CacheScope(5, 6, "org/adapter-1"), DEFAULT_SCOPE])
def test_a_cache_scope_comes_back_equal_on_every_request_that_carries_it(message, scope):
    assert cache_scope_from_proto(through_bytes(message(**cache_scope_fields(scope)))) == scope


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK])
def test_a_streams_end_status_comes_back_as_the_error_its_own_call_would_raise(code):
    piece = duet_pb2.StreamPiece.FromString(end_piece(7, code, f"why {code.name}").SerializeToString())
    assert (piece.stream_id, piece.end) == (7, True)
    error = end_error(piece)
    assert (error.code(), error.details()) == (code, f"why {code.name}")


def test_a_stream_that_ended_ok_carries_no_error_and_an_unknown_code_reads_as_unknown():
    assert end_error(end_piece(3)) is None
    error = end_error(duet_pb2.StreamPiece(stream_id=3, end=True, status_code=999, status_details="?"))
    assert error.code() == grpc.StatusCode.UNKNOWN
