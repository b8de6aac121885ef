"""A checkpoint's fingerprint (services/worker/checkpoint.py) tells apart two checkpoints
served under one name (a rolling upgrade), so their workers never pair nor continue each
other's streams: a change anywhere in the weights, in the tokenizer, or the load-time
quantization changes it; the same files, wherever they lie, keep it."""
from __future__ import annotations

import json
import shutil
import struct

from services.worker.checkpoint import WINDOW_BYTES, WINDOWS, checkpoint_fingerprint
from services.worker.kv_compat import compat_hash
from shared.registry.pairing import pair_problem
from shared.registry.worker_info import WorkerInfo

BIG = WINDOWS * WINDOW_BYTES * 3  # a weight file read in sampled windows


def checkpoint(folder, weights: bytes, tokenizer: str = '{"model": "bpe"}'):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (folder / "tokenizer.json").write_text(tokenizer)
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(weights) // 4], "data_offsets": [0, len(weights)]}})
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + weights)
    return folder


def weights(seed: int = 0) -> bytearray:
    return bytearray((i * 7 + seed) % 251 for i in range(BIG))


def test_the_same_files_anywhere_give_the_same_fingerprint(tmp_path):
    a = checkpoint(tmp_path / "a", weights())
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)
    assert len(checkpoint_fingerprint(a)) == 16


def test_a_fine_tune_changes_it(tmp_path):
    """Fine-tuning changes weights all over a file: the sampled windows see it (a change of a
    few bytes between two windows would not be seen; services/worker/checkpoint.py says why)."""
    base = checkpoint(tmp_path / "base", weights())
    tuned = weights()
    for at in range(0, BIG, 4096):
        tuned[at] ^= 0x5A
    other = checkpoint(tmp_path / "tuned", bytes(tuned))
    assert checkpoint_fingerprint(base) != checkpoint_fingerprint(other)


def test_the_tokenizer_and_the_quantization_are_part_of_it(tmp_path):
    base = checkpoint(tmp_path / "base", weights())
    retok = checkpoint(tmp_path / "retok", weights(), tokenizer='{"model": "bpe", "added": ["<x>"]}')
    assert checkpoint_fingerprint(base) != checkpoint_fingerprint(retok)
    assert checkpoint_fingerprint(base) != checkpoint_fingerprint(base, quantization="fp8")


def test_two_checkpoints_under_one_name_never_pair(tmp_path):
    old = checkpoint_fingerprint(checkpoint(tmp_path / "old", weights(1)))
    new = checkpoint_fingerprint(checkpoint(tmp_path / "new", weights(2)))
    layout = "L2-H2-P16-D64-bfloat16-heads_first"

    def entry(worker_id, role, ckpt):
        return WorkerInfo(worker_id=worker_id, role=role, address="x:1", model="same-name", page_size=16,
                          compat_hash=compat_hash("same-name", layout, ckpt), kv_layout=layout, checkpoint=ckpt)

    assert compat_hash("same-name", layout, old) != compat_hash("same-name", layout, new)
    assert pair_problem(entry("p", "prefill", old), entry("d", "decode", old)) == ""
    problem = pair_problem(entry("p", "prefill", old), entry("d", "decode", new))
    assert problem.startswith("checkpoints differ") and old in problem and new in problem
