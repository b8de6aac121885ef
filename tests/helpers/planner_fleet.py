"""Registry entries and loads for the planner's tests: workers with the step-time model a CPU
worker of the default model fits (seconds per step: 0.17 base, 7 ms a prompt token, 4 ms a
decode row, 0.15 ms a decode context token), and the loads of the must-show test
(tests/e2e/test_e2e_planner.py) as a window of readings would show them."""
from __future__ import annotations

from services.planner.load_window import Load
from shared.perf_model.step_model import StepModel
from shared.perf_model.worker_perf import WorkerPerf
from shared.registry.worker_info import RankKvPool, WorkerInfo, WorkerLoad

MODEL = StepModel.from_dict({"base_s": 0.167, "prefill_token_s": 0.0074, "attended_pair_s": 3.7e-6,
                             "decode_row_s": 0.0036, "context_token_s": 1.5e-4, "samples": 200})
# 0.4 requests/s of 250 uncached prompt tokens, 16 tokens out, ~2 streams decoding
LONG = Load(seconds=10, requests=40, requests_per_s=0.4, prompt_tokens_per_s=100, computed_prompt_tokens_per_s=100,
            output_tokens_per_s=6.4, decode_streams=2.0, decode_context=260, kv_live_pages=40)
# 0.8 requests/s of 330-token prompts of which 30 uncached, 12 tokens out, ~4 streams decoding
CHAT = Load(seconds=10, requests=40, requests_per_s=0.8, prompt_tokens_per_s=264, computed_prompt_tokens_per_s=24,
            output_tokens_per_s=9.6, decode_streams=4.0, decode_context=340, kv_live_pages=90)


def worker(worker_id: str, role: str, *, switchable: bool = True, running: int = 0, kv: float = 0.0,
           model: StepModel | None = MODEL, mem: str = "DRAM", queued: int = 0) -> WorkerInfo:
    pool = RankKvPool(rank=0, agent_name=f"{worker_id}-r0", base_addr=0, page_bytes=36864 * 16, num_pages=400,
                      mem_type=mem)
    return WorkerInfo(worker_id=worker_id, role=role, address="127.0.0.1:1", model="m", page_size=16,
                      max_batched_tokens=1024, kv_pools=[pool], switchable=switchable,
                      load=WorkerLoad(total_pages=400, free_pages=400, running_requests=running, kv_usage=kv,
                                        queued_prefill_tokens=queued),
                      perf=WorkerPerf(step=model, itl_target_s=0.25, budget_floor_tokens=32))


def long_prompts(rate: float, streams: float) -> Load:
    """LONG's requests (250 uncached prompt tokens each) at another rate and decode concurrency."""
    return Load(**{**LONG.__dict__, "requests_per_s": rate, "prompt_tokens_per_s": 250 * rate,
                   "computed_prompt_tokens_per_s": 250 * rate, "decode_streams": streams})
