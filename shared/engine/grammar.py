"""Constrained decoding with xgrammar (what SGLang and vLLM use).

A worker compiles each GrammarSpec once (an LRU keyed by the spec's text; compiled state
never leaves the process), keeps one matcher per request, and fills that request's row of
a packed token bitmask (1 bit per token) that the sampler applies on the logits' device.

JSON is generated compact (`any_whitespace=False`, as vLLM's --disable-any-whitespace):
free whitespace lets small models loop on newlines until max_tokens, which truncates the
JSON; the output is still valid JSON for any schema."""
from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict

import torch

from .grammar_spec import GrammarError, GrammarSpec

# xgrammar (0.2.8) writes the characters of a length-bounded JSON string (minLength /
# maxLength) as [^"\\\r\n]: control characters pass, which is not JSON. Tighten that class
# to what JSON allows unescaped (its unbounded strings already use this one).
_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\]'
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


SERIAL_FILL_BUDGET_S = 0.0005  # host time one step may fill rows one by one before using threads


def _clean(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


def json_schema_grammar(schema: str):
    """The schema as an xgrammar Grammar (compact JSON), strings made valid JSON (above)."""
    import xgrammar as xgr
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS)) if _LOOSE_CHARS in text else grammar


def compile_spec(compiler, spec: GrammarSpec):
    """spec compiled by an xgrammar GrammarCompiler; GrammarError (naming the problem) if bad."""
    try:
        if spec.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if spec.kind == "json_schema":
            return compiler.compile_grammar(json_schema_grammar(spec.text))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        return compiler.compile_grammar(spec.text)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with a C++ location prefix
        raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {_clean(exc)}") from None


class GrammarState:
    """One request's matcher: accepts sampled tokens, fills its bitmask row."""

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarBackend:
    """Per worker: the tokenizer's vocabulary for xgrammar, and the compiled-grammar cache.
    Thread-safe: the RPC handlers compile off the engine thread, the engine makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256,
                 info=None):
        """info: an xgrammar TokenizerInfo to use instead of one made from `tokenizer`."""
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = info if info is not None else xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.words = xgr.get_bitmask_shape(1, vocab_size)[1]
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # cache misses, for tests and metrics
        self._batch = None

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def compile(self, spec: GrammarSpec):
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = compile_spec(self.compiler, spec)
        with self._lock:
            self.compiles += 1
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def adopt(self, spec: GrammarSpec, serialized: str) -> None:
        """Cache spec's grammar compiled elsewhere (a helper process, grammar_guard.py)."""
        compiled = self._xgr.CompiledGrammar.deserialize_json(serialized, self.info)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def new_state(self, spec: GrammarSpec, tokens: list[int] = ()) -> GrammarState:
        """A fresh matcher advanced by `tokens` (those sampled elsewhere: the handoff)."""
        state = GrammarState(self._xgr.GrammarMatcher(self.compile(spec)))
        for t in tokens:
            if not state.accept(t):
                raise GrammarError(f"token {t} does not fit the request's grammar")
        return state

    def alloc_bitmask(self, rows: int, pin: bool) -> torch.Tensor:
        mask = torch.full((rows, self.words), -1, dtype=torch.int32)
        return mask.pin_memory() if pin else mask

    def fill(self, states: list[GrammarState | None], bitmask: torch.Tensor) -> list[int]:
        """Fill the rows of live matchers (all-ones elsewhere); returns those row indices."""
        rows = [i for i, s in enumerate(states) if s is not None and not s.terminated]
        if not rows:
            return rows
        # Most rows cost microseconds (the token-mask cache answers); xgrammar's batch matcher
        # starts threads per call, which at decode batch sizes costs more than the rows
        # themselves (the whole cost of constrained decoding there). So rows go one by one,
        # and only a batch whose rows turn out expensive (e.g. bounded strings, a hundred
        # times a cached row) hands the rest to the threads.
        t0 = time.perf_counter()
        for k, i in enumerate(rows):
            states[i].matcher.fill_next_token_bitmask(bitmask, i)
            rest = rows[k + 1:]
            if rest and len(rest) >= 4 and time.perf_counter() - t0 > SERIAL_FILL_BUDGET_S:
                if self._batch is None:
                    self._batch = self._xgr.BatchGrammarMatcher(max_threads="auto")
                self._batch.batch_fill_next_token_bitmask([states[j].matcher for j in rest], bitmask, rest)
                break
        return rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[rows, t] = -inf where bit t of bitmask[row] is 0 (bitmask on the host: it is
    copied to the logits' device without a sync when pinned)."""
    import xgrammar as xgr
    mask = bitmask[: logits.shape[0]]
    every_row = len(rows) == logits.shape[0]  # rows are sorted and distinct
    indices = None if every_row else rows
    if logits.device.type != "cpu":
        # pinned host memory: a copy from pageable memory would wait for the device to idle
        mask = (mask if mask.is_pinned() else mask.pin_memory()).to(logits.device, non_blocking=True)
        if not every_row:
            indices = torch.tensor(rows, dtype=torch.int32).pin_memory().to(logits.device, non_blocking=True)
    backend = _APPLY_BACKEND.get(logits.device.type, "auto")
    try:
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=indices, backend=backend)
    except Exception as exc:  # e.g. xgrammar's Triton kernel on an untested Triton: plain torch instead
        if backend == "torch_native":
            raise
        logging.getLogger("duet.engine").warning("xgrammar's %s bitmask kernel failed (%s); using torch", backend, exc)
        _APPLY_BACKEND[logits.device.type] = "torch_native"
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=indices,
                                        backend="torch_native")


_APPLY_BACKEND: dict[str, str] = {}  # device type -> xgrammar backend, once "auto" failed there
