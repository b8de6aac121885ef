"""What the benchmarks that start `duet up` stacks on this host's GPUs share (hetero_tp.py,
stack_gpu.py): the process set-up, a model folder's tokenizer files, and running each
configuration so that one failing does not hide the others."""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import sys
from typing import Callable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def copy_tokenizer(src: pathlib.Path, dst: pathlib.Path) -> None:
    """The tokenizer files src has, copied into the model folder dst."""
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)


def start_run(out: str) -> pathlib.Path:
    """Process set-up before any stack starts; returns the output folder (created)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the stacks
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_each(names: str, run: Callable[[str], list[dict]]) -> list[dict]:
    """run(name) for each name of a comma list, rows concatenated; a failure is printed and
    the next name runs."""
    rows: list[dict] = []
    for name in (x for x in names.split(",") if x):
        try:
            rows += run(name)
        except Exception as e:  # noqa: BLE001 - one configuration failing must not hide the others
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
    return rows
