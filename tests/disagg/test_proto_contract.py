"""The gRPC contract: committed generated code matches duet.proto, imports on older
runtimes' guards, and every service works over real grpc.aio."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from protos import duet_pb2, duet_pb2_grpc
from services.decode.stream_mux import GenerateStreamsServicer
from protos import regenerate

PROTOS = Path(regenerate.__file__).resolve().parent


def test_committed_code_matches_proto_source():
    # protoc runs in a child process: grpc_tools' native protoc and NIXL's libraries crash
    # when loaded into one process (other tests in this session load NIXL).
    pytest.importorskip("grpc_tools")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "duet.desc"
        code = ("import sys, importlib.resources; from grpc_tools import protoc; "
                "sys.exit(protoc.main(['protoc', sys.argv[1], '-I' + str(importlib.resources.files('grpc_tools') "
                "/ '_proto'), '--descriptor_set_out=' + sys.argv[2], sys.argv[3]]))")
        subprocess.run([sys.executable, "-c", code, f"-I{regenerate.REPO_ROOT}", str(out),
                        str(regenerate.REPO_ROOT / regenerate.PROTO_FILE)], check=True, timeout=60)
        fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    messages = list(fresh.message_type)  # protoc's descriptor set adds json_name; the gencode omits it
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)  # map fields are nested entry messages
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(duet_pb2.DESCRIPTOR.serialized_pb)
    assert committed == fresh, "protos/duet.proto changed: run `python protos/regenerate.py` and commit"


def test_version_guards_are_lowered_to_supported_floor():
    pb2 = (PROTOS / "duet_pb2.py").read_text()
    grpc_code = (PROTOS / "duet_pb2_grpc.py").read_text()
    major, minor, patch = regenerate.MIN_PROTOBUF
    guard = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
                      pb2)
    assert guard and tuple(map(int, guard.groups())) == (major, minor, patch)
    assert f"GRPC_GENERATED_VERSION = '{regenerate.MIN_GRPCIO}'" in grpc_code
    assert "from protos import duet_pb2" in grpc_code  # package-relative import, works from any cwd
    # the lowering refuses silently-changed protoc output instead of shipping a strict guard
    with pytest.raises(RuntimeError):
        regenerate.relax_version_guards("no guard here", grpc_code)


def test_message_semantics():
    sp = duet_pb2.SamplingParams(temperature=0.0, max_tokens=8)
    assert not sp.HasField("seed")
    sp.seed = 0
    assert sp.HasField("seed")  # seed 0 is a real seed, distinct from "no seed"
    gen = duet_pb2.GenerateRequest(request_id="r")
    assert not gen.HasField("reservation") and not gen.HasField("first_token")  # colocated request
    gen.reservation.CopyFrom(duet_pb2.Reservation(reservation_id=2**63, generation=7,
                                                  ranks=[duet_pb2.RankPages(rank=0, page_ids=[3, 4])]))
    back = duet_pb2.GenerateRequest.FromString(gen.SerializeToString())
    assert back.HasField("reservation") and back.reservation.reservation_id == 2**63
    assert duet_pb2.RouteRequest(page_hashes=[2**64 - 1]).page_hashes[0] == 2**64 - 1
    assert duet_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"


class FakeDecode(GenerateStreamsServicer, duet_pb2_grpc.DecodeServicer):
    """A tiny servicer: exercises the generated stubs, not any Duet logic."""

    async def Reserve(self, request, context):
        if request.prompt_tokens > 100:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
        return duet_pb2.Reservation(reservation_id=1, generation=1, decode_worker_id="d",
                                    ranks=[duet_pb2.RankPages(rank=0, agent_name="a", page_ids=[1])])

    async def Cancel(self, request, context):
        return duet_pb2.CancelReply(cancelled=request.reservation_id == 1)

    async def Generate(self, request, context):
        for i in range(3):
            yield duet_pb2.TokenChunk(tokens=[duet_pb2.Token(id=i, logprob=-0.5)])
        yield duet_pb2.TokenChunk(finish_reason=duet_pb2.FINISH_REASON_LENGTH,
                                  usage=duet_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                       completion_tokens=3))


class FakePrefill(duet_pb2_grpc.PrefillServicer):
    async def Prefill(self, request, context):
        return duet_pb2.PrefillReply(first_token=duet_pb2.Token(id=9), computed_tokens=len(request.prompt_token_ids),
                                     kv_bytes_sent=123)


def test_services_round_trip_over_grpc_aio():
    async def scenario():
        server = grpc.aio.server()
        duet_pb2_grpc.add_DecodeServicer_to_server(FakeDecode(), server)
        duet_pb2_grpc.add_PrefillServicer_to_server(FakePrefill(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            decode = duet_pb2_grpc.DecodeStub(channel)
            prefill = duet_pb2_grpc.PrefillStub(channel)
            res = await decode.Reserve(duet_pb2.ReserveRequest(prompt_tokens=10))
            assert res.ranks[0].page_ids == [1]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await decode.Reserve(duet_pb2.ReserveRequest(prompt_tokens=1000))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await decode.Cancel(duet_pb2.CancelRequest(reservation_id=1))).cancelled
            reply = await prefill.Prefill(duet_pb2.PrefillRequest(prompt_token_ids=[1, 2, 3], reservation=res))
            assert reply.first_token.id == 9 and reply.computed_tokens == 3
            chunks = [c async for c in decode.Generate(duet_pb2.GenerateRequest(prompt_token_ids=[1, 2]))]
            assert [t.id for c in chunks for t in c.tokens] == [0, 1, 2]
            assert chunks[-1].finish_reason == duet_pb2.FINISH_REASON_LENGTH and chunks[-1].usage.prompt_tokens == 2
        await server.stop(None)

    asyncio.run(scenario())
