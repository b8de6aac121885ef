"""A colocated worker with --tp 2 (two processes, gloo) serves the same greedy tokens as
the offline engine at TP=1, over real gRPC with a real Redis registry; the worker
answers grpc.health.v1. (Split roles with TP: tests/disagg/test_disagg_tp.py.)"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
import torch

from protos import duet_pb2, duet_pb2_grpc
from tests.helpers.engine_models import build_model_dir
from tests.helpers.redis_server import RedisServer, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(args, log):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "services.cli", "worker", *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tp") / "llama", "llama_tied_gqa2")


def test_both_worker_tp2_matches_tp1(model_dir, tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shared.engine import LLM, SamplingParams
    prompts = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 61))]
    torch.set_num_threads(1)
    ref = [r.token_ids for r in LLM(str(model_dir), dtype="float32").generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    with RedisServer() as redis:
        port = free_port()
        log = (tmp_path / "worker.log").open("wb")
        proc = _worker(["--role", "both", "--tp", "2", "--model", str(model_dir), "--dtype", "float32",
                        "--port", str(port), "--redis-url", redis.url, "--threads", "1"], log)
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "worker never became SERVING"
                time.sleep(0.5)
            stub = duet_pb2_grpc.DecodeStub(channel)
            for prompt, want in zip(prompts, ref):
                sp = duet_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, top_p=1.0)
                got, usage = [], None
                for chunk in stub.Generate(duet_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sp),
                                           timeout=120):
                    got += [t.id for t in chunk.tokens]
                    if chunk.finish_reason:
                        usage = chunk.usage
                assert got == want
                assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 12
        finally:
            proc.terminate()
            proc.wait(60)
            log.close()
        assert proc.returncode == 0, (tmp_path / "worker.log").read_text()[-3000:]
