"""A checkpoint's fingerprint: which weights and tokenizer a worker serves, beyond the model's
name. Two workers continue each other's work (a KV handoff, a migrated stream) only when
their fingerprints match, so a rolling upgrade that serves two checkpoints under one name
never mixes them (services/worker/kv_compat.py folds it into the compat hash).

The digest covers config.json, the tokenizer files whole, and of each weight file its name,
size, its safetensors header (names, dtypes, shapes, offsets) and 64 windows of 64 KiB spread
over its bytes: a fine-tune changes weights everywhere, and reading 4 MiB a file keeps a
worker's start quick where hashing every byte of a large checkpoint would not. The engine's
load-time quantization changes the weights it computes with, so it is part of it too."""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path

_WHOLE = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
          "merges.txt", "special_tokens_map.json", "added_tokens.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WINDOWS = 64
WINDOW_BYTES = 64 << 10


def checkpoint_fingerprint(model_dir: str | Path, quantization: str = "none") -> str:
    """16 hex digits naming the checkpoint in model_dir as this worker serves it."""
    root = Path(model_dir)
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"quantization={quantization}\n".encode())
    for name in _WHOLE:
        path = root / name
        if path.is_file():
            digest.update(f"{name}\n".encode())
            digest.update(path.read_bytes())
    for path in sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)):
        _weight_file(digest, path)
    return digest.hexdigest()


def _weight_file(digest, path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name} {size}\n".encode())
    with path.open("rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(min(header_len, size - 8)))
        if size <= WINDOWS * WINDOW_BYTES:
            f.seek(0)
            digest.update(f.read())
            return
        stride = (size - WINDOW_BYTES) // (WINDOWS - 1)
        for i in range(WINDOWS):
            f.seek(i * stride)
            digest.update(f.read(WINDOW_BYTES))
