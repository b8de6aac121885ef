"""Where `duet up` puts its workers: own GPUs when there are enough (KV from --mem-fraction),
shared GPUs with a KV budget that fits beside the others, whole blocks of `tp` GPUs per
worker, host memory on a CPU host or with --device cpu. (The placement is pure logic; on a
GPU host `duet up` passes it to each worker as CUDA_VISIBLE_DEVICES and --kv-cache-memory.)"""
from __future__ import annotations

import subprocess
import sys

import pytest

from services.launcher.gpus import HOST_TIER_FRACTION, SHARED_FRACTION, Placement, WorkerFlags, plan, visible_gpus

GIB = 1 << 30


def test_a_host_without_a_gpu_driver_is_answered_without_importing_torch():
    # `duet up` asks at every start; torch's import is a second of CPU for the same answer
    code = ("import sys; from services.launcher.gpus import visible_gpus; "
            "assert visible_gpus() == []; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_cpu_host_gives_every_worker_the_cpu_budget():
    assert visible_gpus() == []  # this machine has none
    assert plan(3, WorkerFlags(), []) == [Placement((), "512M")] * 3
    assert plan(2, WorkerFlags(), [], explicit_kv="2G") == [Placement((), "2G")] * 2
    assert Placement((), "512M").env() == {}


def test_enough_gpus_one_each_sized_by_mem_fraction():
    places = plan(2, WorkerFlags(), [0, 1], card_bytes=80 * GIB, model_bytes=GIB)
    assert [p.gpus for p in places] == [(0,), (1,)]
    assert all(p.kv_cache_memory is None and not p.shared for p in places)
    assert places[1].env() == {"CUDA_VISIBLE_DEVICES": "1"}


def test_tp_blocks_follow_the_visible_indices():
    places = plan(2, WorkerFlags(tp=2), [2, 3, 6, 7], card_bytes=80 * GIB)
    assert [p.env()["CUDA_VISIBLE_DEVICES"] for p in places] == ["2,3", "6,7"]
    assert not any(p.shared for p in places)
    by_uuid = plan(2, WorkerFlags(), ["GPU-aa", "GPU-bb"], card_bytes=80 * GIB)
    assert [p.env()["CUDA_VISIBLE_DEVICES"] for p in by_uuid] == ["GPU-aa", "GPU-bb"]


def test_too_few_gpus_share_round_robin_with_a_budget_that_fits():
    card, model = 80 * GIB, 16 * GIB
    places = plan(3, WorkerFlags(), [0, 1], card_bytes=card, model_bytes=model)
    assert [p.gpus for p in places] == [(0,), (1,), (0,)]
    assert [p.shared for p in places] == [True, False, True]  # GPU 1 holds one worker alone
    assert places[1].kv_cache_memory is None  # it sizes from --mem-fraction, as a pod does
    kv = int(places[0].kv_cache_memory)
    assert kv == int(card * SHARED_FRACTION / 2) - model - GIB  # two workers on GPU 0
    assert 2 * (kv + model + GIB) <= card  # both fit on the busiest card
    # tp 2 on two GPUs, prefill + decode: both on the pair, each with half the model per GPU
    tp = plan(2, WorkerFlags(tp=2), [0, 1], card_bytes=card, model_bytes=model)
    assert [p.gpus for p in tp] == [(0, 1), (0, 1)]
    assert int(tp[0].kv_cache_memory) == int(card * SHARED_FRACTION / 2) - model // 2 - GIB


def test_a_given_budget_wins_and_cpu_device_ignores_gpus():
    assert plan(3, WorkerFlags(kv_cache_memory="4G"), [0], card_bytes=80 * GIB)[2].kv_cache_memory == "4G"
    assert plan(2, WorkerFlags(), [0, 1], explicit_kv="6G")[0].kv_cache_memory == "6G"
    assert plan(2, WorkerFlags(device="cpu"), [0, 1]) == [Placement((), "512M")] * 2


def test_tp_larger_than_the_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="--tp 4 needs 4 GPUs; 2 visible"):
        plan(2, WorkerFlags(tp=4), [0, 1])


def test_worker_flags_are_read_from_the_args_after_the_double_dash():
    flags = WorkerFlags.parse(["--page-size", "32", "--tp", "2", "--device", "cuda", "--kv-cache-memory", "3G",
                               "--kv-host-memory", "9G"])
    assert flags == WorkerFlags(tp=2, device="cuda", kv_cache_memory="3G", kv_host_memory="9G")
    assert WorkerFlags.parse(["--page-size", "8"]).tp == 1


def test_prefill_and_decode_at_different_tp_sizes_share_what_they_must():
    card, model = 141 * GIB, 16 * GIB
    # prefill tp 2 over both GPUs, decode tp 1 beside it on GPU 0
    places = plan(2, WorkerFlags(), [0, 1], card_bytes=card, model_bytes=model, tps=[2, 1])
    assert [p.gpus for p in places] == [(0, 1), (0,)]
    assert all(p.shared for p in places)
    # GPU 0 holds half of prefill's weights and all of decode's; what is left is split evenly
    room = card * SHARED_FRACTION - (model // 2 + GIB) - (model + GIB)
    assert int(places[0].kv_cache_memory) == int(places[1].kv_cache_memory) == int(room / 2)
    # four GPUs: prefill tp 2 on 0-1, decode tp 2 on 2-3, nothing shared
    four = plan(2, WorkerFlags(), [0, 1, 2, 3], card_bytes=card, tps=[2, 2])
    assert [p.gpus for p in four] == [(0, 1), (2, 3)] and not any(p.shared for p in four)


def test_a_shared_card_and_the_host_tier_are_divided_by_role():
    """Decode workers hold conversations between turns (and prefill later turns themselves):
    on one shared card they get twice a prefill worker's KV room and host tier."""
    card, model, host = 80 * GIB, 16 * GIB, 120 * GIB
    places = plan(2, WorkerFlags(), [0], card_bytes=card, model_bytes=model, roles=["prefill", "decode"],
                  host_bytes=host)
    room = card * SHARED_FRACTION - 2 * (model + GIB)
    assert [int(p.kv_cache_memory) for p in places] == [int(room / 3), int(room * 2 / 3)]
    assert [int(p.kv_host_memory) for p in places] == [int(host * HOST_TIER_FRACTION / 3),
                                                        int(host * HOST_TIER_FRACTION * 2 / 3)]
    # a host tier the user sized is theirs; on the CPU nothing is planned
    given = plan(2, WorkerFlags(kv_host_memory="4G"), [0], card_bytes=card, model_bytes=model,
                 roles=["prefill", "decode"], host_bytes=host)
    assert [p.kv_host_memory for p in given] == [None, None]
    assert all(p.kv_host_memory is None for p in plan(2, WorkerFlags(), [], roles=["prefill", "decode"]))
