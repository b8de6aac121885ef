"""The TMA-ring probe's Gluon kernels (loadtest/bench/fp8_ring_gemv_probe.py) compile for the GPU.

Gluon has no interpreter, so the kernels' numbers are only checked on a GPU (the probe compares
every run's outputs with the fp32 chain). Here each launch the probe makes (a linear alone, with
and without split K, gate/up, PDL; the whole chain as one persistent kernel, one and two TMA boxes
a step) is bound as a GPU launch would be (tests/helpers/triton_lowering.py's Recorder, nothing
runs) and compiled for sm_90 down to PTX and the cubin, on empty CPU tensors. What the PTX must
hold is what makes these kernels what the notes say they are: TMA bulk copies into shared memory,
mbarrier waits, the PDL wait where asked, atomics only where K is split, and a ring as deep as
configured."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")


@pytest.fixture(scope="module")
def compiled():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource

    from loadtest.bench import fp8_ring_gemv_probe as probe
    from loadtest.bench.persistent_chain_probe import random_layers
    from tests.helpers.triton_lowering import Recorder

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    layer = random_layers(1, "cpu", qkv=384, hidden=256, inter=512)[0]
    x = torch.zeros(256, dtype=torch.bfloat16)
    ws = probe.RingWorkspace.create("cpu", 2048)
    saved_sms, probe._sms = probe._sms, lambda dev: 132
    cases = []
    try:
        with Recorder(backend) as rec:
            for name, kw in (("alone", {"programs": 8}), ("split", {"programs": 64}),
                             ("gate_up split", {"programs": 64, "gate_up": True})):
                w = layer["gu"] if kw.get("gate_up") else layer["o"]
                probe.fp8_ring_gemv(x, w, out=torch.empty(256, dtype=torch.bfloat16), block_n=16, block_k=128,
                                    stages=3, warps=4, pdl=name == "alone", workspace=ws, **kw)
                cases.append((name, 3 * 16 * 128 * (2 if kw.get("gate_up") else 1)))
            for boxes in (1, 2):
                run, _ = probe.persistent_ring_chain([layer], x.view(1, -1), (16, 128, 2, 4, 1, boxes))
                run()
                cases.append((f"persistent, {boxes} boxes a step", 2 * 2 * boxes * 16 * 128))
    finally:
        probe._sms = saved_sms
    out = {}
    for (name, ring_bytes), launch in zip(cases, rec.launches):
        kernel = triton.compile(GluonASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs),
                                target=target, options=launch.options.__dict__)
        out[name] = (kernel.asm["ptx"], kernel.metadata.shared, ring_bytes, launch)
    assert len(out) == 5, list(out)
    return out


def test_every_launch_streams_through_tma_and_mbarriers(compiled):
    for name, (ptx, shared, ring_bytes, _) in compiled.items():
        assert "cp.async.bulk.tensor" in ptx, name  # weight tiles by TMA, not by loads
        assert "mbarrier.try_wait" in ptx, name  # each slot waited on
        assert ring_bytes <= shared < ring_bytes + 4096, (name, shared, ring_bytes)  # the ring, its barriers


def test_pdl_and_split_k_only_where_asked(compiled):
    pdl = {name: "griddepcontrol.wait" in ptx for name, (ptx, *_) in compiled.items()}
    assert pdl == {"alone": True, "split": False, "gate_up split": False, "persistent, 1 boxes a step": False,
                   "persistent, 2 boxes a step": False}
    for name, (ptx, _, _, launch) in compiled.items():
        atomics = "atom.global" in ptx or "red.global" in ptx
        split = "split" in name  # the split-K partials and arrival counters; the persistent kernels' grid barrier
        assert atomics == (split or name.startswith("persistent")), name
    coop = {name: launch.options.launch_cooperative_grid for name, (*_, launch) in compiled.items()}
    assert coop == {"alone": False, "split": False, "gate_up split": False, "persistent, 1 boxes a step": True,
                    "persistent, 2 boxes a step": True}


def test_split_k_is_the_fewest_chunks_that_feed_every_program():
    from loadtest.bench.fp8_ring_gemv_probe import ring_split
    assert ring_split(tiles=256, ksteps=16, programs=132) == 1
    assert ring_split(tiles=96, ksteps=16, programs=396) == 8  # 96 x 4 = 384 < 396
    assert ring_split(tiles=16, ksteps=4, programs=396) == 4  # no more than K's steps allow
