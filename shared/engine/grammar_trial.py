"""In a grammar helper process (grammar_guard.py): refuse a JSON schema with keywords the
grammar engine would not enforce (shared/openai_protocol/json_schema_support.py), compile a
grammar with the model's vocabulary, within the time budget (the caller kills this process
past it), and check that an output can begin (a grammar that allows no first token would
fail on the worker, "token 0 does not fit the grammar"; a JSON grammar that allows only the
end would answer ""). The gateway only wants the verdict; a worker also takes a slow
compile's result back (serialized, far cheaper to load than to compile again), and compiles
a quick one again itself."""
from __future__ import annotations

import json
import pickle
import time
from dataclasses import dataclass

from shared.openai_protocol.json_schema_support import schema_problem

from .grammar import compile_spec
from .grammar_limits import too_slow
from .grammar_spec import GrammarError, GrammarSpec

SHIP_AFTER_S = 0.2  # a compile this slow is sent back rather than done twice


@dataclass
class Compilers:
    """A helper's state: the vocabulary, and the compiler over it made on first use. The setup
    runs in the pool's zygote, which forks every helper: a compiler made there could leave a
    thread of its own behind a lock the helper then waits on forever (seen after a compile)."""

    info: object  # xgrammar.TokenizerInfo
    _compiler: object = None

    @property
    def compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return self._compiler


def setup_from_tokenizer(tokenizer_pickle: bytes) -> Compilers:
    """The gateway's helper: a compiler over a (pickled) Hugging Face tokenizer's vocabulary."""
    import xgrammar as xgr
    tokenizer = pickle.loads(tokenizer_pickle)
    return Compilers(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))


def setup_from_info(tokenizer_info_json: str) -> Compilers:
    """A worker's helper: a compiler over the worker's own xgrammar TokenizerInfo."""
    import xgrammar as xgr
    return Compilers(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json))


def trial_compile(state: Compilers, kind: str, text: str, budget_s: float, ship: bool) -> str | None:
    """None, or (ship) the compiled grammar as xgrammar's JSON when it was slow to make.
    GrammarError, which goes back to the caller, when it is bad or took past budget_s."""
    started = time.monotonic()
    if kind == "json_schema":
        trial_schema(state, text)
    compiled = compile_spec(state.compiler, GrammarSpec(kind, text))
    check_can_start(compiled, kind)
    took = time.monotonic() - started
    if took > budget_s:  # the caller's hard limit is longer when it wants the result shipped
        raise GrammarError(too_slow(kind, budget_s))
    return compiled.serialize_json() if ship and took >= SHIP_AFTER_S else None


def trial_schema(state: Compilers, text: str) -> None:
    """GrammarError naming the first keyword of the JSON schema `text` that the grammar engine
    would not enforce (the compiler is not needed: the pool hands every call its setup)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return  # not JSON: the compile says so
    problem = schema_problem(schema)
    if problem is not None:
        raise GrammarError(str(problem))


def check_can_start(compiled, kind: str) -> None:
    """GrammarError when no output can begin: no token is allowed first, or (JSON, which is
    never empty) only the end is."""
    import torch
    import xgrammar as xgr
    info = compiled.tokenizer_info
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
    bits = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: info.vocab_size]
    if kind in ("json_schema", "json_object"):
        bits[list(info.stop_token_ids)] = 0
    if not bool(bits.any()):
        what = "JSON value" if kind.startswith("json") else "text"
        raise GrammarError(f"no {what} fits this {kind.replace('_', ' ')}: its grammar allows no output to begin")
