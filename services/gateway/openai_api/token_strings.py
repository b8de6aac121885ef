"""A token's text and raw bytes, for logprobs output.

One token may hold part of a UTF-8 character. OpenAI then reports the token as
"bytes:\\xe4\\xbd" and gives the raw bytes in `bytes`; we do the same. Raw bytes come
from the tokenizer's own scheme: GPT-2 style byte-level symbols, or SentencePiece
"<0xNN>" byte-fallback pieces; otherwise the decoded text's UTF-8.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_decoder_map() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable latin-1 bytes stand for themselves,
    the rest are shifted to code points 256.. in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    mapping = {chr(b): b for b in printable}
    mapping.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return mapping


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


@dataclass
class TokenStrings:
    tokenizer: Any
    _cache: dict[int, tuple[str, list[int]]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._byte_map = _byte_level_decoder_map() if _is_byte_level(self.tokenizer) else None
        self._special_ids = set(getattr(self.tokenizer, "all_special_ids", ()))

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """(token text, its raw bytes)."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._raw_bytes(token_id)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if token_id in self._special_ids:
                return piece.encode("utf-8")
            byte_piece = _BYTE_PIECE.match(piece)
            if byte_piece:
                return bytes([int(byte_piece.group(1), 16)])
            if self._byte_map is not None:
                if all(ch in self._byte_map for ch in piece):
                    return bytes(self._byte_map[ch] for ch in piece)
            else:
                # SentencePiece: "▁" marks a space; decoding alone would strip it.
                return piece.replace("▁", " ").encode("utf-8")
        text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text.replace("▁", " ").encode("utf-8")
