"""A synthetic tokenizer vocabulary for grammar tests that must run without tokenizer files
(the GPU image has none and no network)."""
from __future__ import annotations

import numpy as np


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    """A byte-level BPE-like vocabulary: the 256 bytes, then pieces drawn like an
    English/code/JSON BPE's: words with or without a leading space or capital, digit runs,
    punctuation and JSON pairs, whitespace runs. Mask cost depends on how many tokens fit a
    grammar state; this mix costs within 2x of SmolLM2's real vocabulary at the same size."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
    weights = np.array([12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0,
                        2.0, 1.9, 1.5, 1.0, 0.8, 0.2, 0.2, 0.1, 0.1])
    weights /= weights.sum()
    punct = [b'{"', b'"}', b'",', b'":', b'["', b'"]', b'":"', b'","', b'},', b'{', b'}', b'[', b']', b',', b':',
             b'.', b'(', b')', b'()', b'):', b';', b'->', b'==', b'!=', b'\\n', b'\\"', b"'", b"',", b'-', b'_']
    vocab, seen = [bytes([b]) for b in range(256)], set()
    seen.update(vocab)
    while len(vocab) < size:
        r = rng.random()
        if r < 0.80:
            word = bytes(rng.choice(letters, size=int(rng.integers(2, 10)), p=weights))
            if rng.random() < 0.15:
                word = word[:1].upper() + word[1:]
            tok = (b" " + word) if rng.random() < 0.5 else word
        elif r < 0.88:
            space = b" " if rng.random() < 0.3 else b""
            tok = space + str(int(rng.integers(0, 10 ** int(rng.integers(1, 4))))).encode()
        elif r < 0.97:
            tok = b"".join(punct[int(i)] for i in rng.integers(len(punct), size=int(rng.integers(1, 3))))
        else:
            tok = b" " * int(rng.integers(2, 16)) if rng.random() < 0.5 else b"\n" + b" " * int(rng.integers(0, 12))
        if tok not in seen:
            seen.add(tok)
            vocab.append(tok)
    return vocab


def synthetic_info(vocab_size: int, stop_ids: list[int]):
    """xgrammar's tokenizer info over synthetic_vocab, the stop ids as special tokens."""
    import xgrammar as xgr
    vocab = synthetic_vocab(vocab_size)
    for i in stop_ids:  # special tokens: never text
        vocab[i] = f"<|special_{i}|>".encode()
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids)
