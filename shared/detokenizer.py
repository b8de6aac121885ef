"""Incremental detokenization that never splits a character.

Byte-level tokenizers (GPT-2/Llama-3/Qwen style) and SentencePiece byte fallback
can spread one UTF-8 character over several tokens; decoding a partial sequence
yields U+FFFD. Decoding each token alone also loses context (SentencePiece drops
the leading space of a word at the start of a decode). So, as vLLM and TGI do, we
keep two offsets into the token list:

    prefix_offset .. read_offset   tokens already emitted, decoded again as context
    read_offset   .. end           tokens not yet emitted

and emit `decode(prefix..end)[len(decode(prefix..read)):]` only when it grew and
does not end in U+FFFD (a character still incomplete). Then both offsets move on.
The decode window stays a few tokens long, so each step costs O(1) decode work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context for the first generated token (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so after this many held tokens that still
# end in U+FFFD the bytes are genuinely invalid (or the model emitted U+FFFD itself):
# release them rather than hold text back forever.
MAX_HELD_TOKENS = 6


@dataclass
class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of complete-character text pieces.

    tokenizer: any Hugging Face tokenizer (only `.decode` is used).
    prompt_token_ids: the prompt; its last few tokens are decoding context only.
    """

    tokenizer: Any
    prompt_token_ids: Iterable[int] = ()
    skip_special_tokens: bool = True
    token_ids: list[int] = field(init=False)
    prefix_offset: int = field(init=False)
    read_offset: int = field(init=False)
    num_generated: int = field(init=False, default=0)
    _prefix_text: str = field(init=False, default="")

    def __post_init__(self) -> None:
        context = list(self.prompt_token_ids)[-PROMPT_CONTEXT_TOKENS:]
        self.token_ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._prefix_text = self._decode(0, self.read_offset)

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self.token_ids[start:end]
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    @property
    def held_tokens(self) -> int:
        """Tokens received whose text has not been emitted yet."""
        return len(self.token_ids) - self.read_offset

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add generated token(s); return the text that is now complete ("" if none)."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        emitted = []
        for token_id in token_ids:
            self.token_ids.append(int(token_id))
            self.num_generated += 1
            emitted.append(self._step(force=False))
        return "".join(emitted)

    def flush(self) -> str:
        """At the end of generation: emit whatever is still held, U+FFFD included."""
        return self._step(force=True)

    def _step(self, force: bool) -> str:
        if self.held_tokens == 0:
            return ""
        new_text = self._decode(self.prefix_offset)
        grew = len(new_text) > len(self._prefix_text)
        incomplete = new_text.endswith(REPLACEMENT_CHAR) and self.held_tokens < MAX_HELD_TOKENS
        if not force and (not grew or incomplete):
            # Hold back: a character is still being assembled, or the new tokens
            # decode to nothing visible yet (e.g. skipped special tokens). The window
            # keeps its left context so a later leading space is not lost.
            return ""
        delta = new_text[len(self._prefix_text):]
        # The emitted tokens become the next step's context; the window stays short.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return delta
