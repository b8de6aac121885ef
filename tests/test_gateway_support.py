"""Helpers shared by the gateway and detokenizer tests (no tests in here).

Real tokenizers are built on the spot with the `tokenizers` library and saved as a
model folder that transformers' AutoTokenizer loads, so the tests need no download:
  * byte_level_tokenizer_dir: GPT-2/Qwen style byte-level BPE with a ChatML chat
    template; its merges split CJK characters and emoji across tokens.
  * sentencepiece_tokenizer_dir: Llama-2 style Metaspace BPE with byte fallback,
    whose decoder strips the leading space at the start of a decode.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog. Hello there! " * 3,
    "你好世界，今天天气很好。我们一起去公园吧。" * 3,
    "Emoji time 😀🎉👍🏽 café naïve résumé Ελληνικά русский " * 3,
    "The answer is 42. STOP here. The end. " * 3,
]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer_dir(folder: Path, max_position_embeddings: int = 256) -> Path:
    """Save a byte-level BPE tokenizer (+ a config.json with the context length) in folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    config = {"model_type": "qwen2", "max_position_embeddings": max_position_embeddings,
              "eos_token_id": fast.eos_token_id}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def sentencepiece_tokenizer_dir(folder: Path) -> Path:
    """Save a Llama-2 style tokenizer: Metaspace words, <0xNN> byte fallback, space strip."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=60, show_progress=False)
    base.train_from_iterator([CORPUS[0], CORPUS[3]], trainer)
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["unk_token"] = "<unk>"
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder
