"""A request's grammar, checked within the server's limits before anyone compiles it for real:
size first (grammar_limits.py), then, in a helper process with a hard time budget
(shared/process_pool), a JSON schema's keywords (what the grammar engine would not enforce
is refused, shared/openai_protocol/json_schema_support.py) and a trial compile, so a schema
that would take minutes costs at most the budget, never on a serving event loop or an engine
thread. Verdicts are remembered (by digest), so a schema seen before is answered at once.

The gateway checks with its tokenizer's vocabulary; each worker checks again with its own
(the same limits: a worker never trusts that someone checked) and takes the helper's result
when the compile was slow (`ship`: serialized, loaded in a fraction of the compile's time),
so an accepted grammar is compiled once per process. The verdict is on the compile's own
time in both; a worker's helper gets twice the budget to also serialize the result."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

from shared.process_pool.pool import CallFailed, CallTimeout, ProcessPool

from .grammar_limits import GrammarLimits, check_size, too_slow
from .grammar_spec import GrammarError, GrammarSpec

_TRIAL = "shared.engine.grammar_trial"


class GrammarGuard:
    def __init__(self, limits: GrammarLimits, setup: str, setup_args: tuple | Callable[[], tuple],
                 ship: bool = False, verdicts: int = 4096):
        self.limits = limits
        self.ship = ship
        self.pool = ProcessPool("grammar", setup, setup_args, processes=limits.processes)
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()  # digest -> "" (fine) or the problem
        self._max_verdicts = verdicts
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, limits: GrammarLimits, tokenizer) -> "GrammarGuard":
        import pickle
        return cls(limits, f"{_TRIAL}:setup_from_tokenizer", lambda: (pickle.dumps(tokenizer),))

    @classmethod
    def for_tokenizer_info(cls, limits: GrammarLimits, info_json: Callable[[], str]) -> "GrammarGuard":
        return cls(limits, f"{_TRIAL}:setup_from_info", lambda: (info_json(),), ship=True)

    async def check(self, spec: GrammarSpec, keywords_only: bool = False) -> str | None:
        """GrammarError (the message says why) unless spec compiles within the limits (a JSON
        schema: and the grammar engine enforces all of it). Returns the compiled grammar
        serialized (xgrammar's JSON) when shipped, else None. keywords_only: a JSON schema's
        size and keywords, no compile (a part of a larger schema, checked for its own message)."""
        if spec.kind == "json_object":
            return None  # built in: nothing of the client's to compile
        key = hashlib.sha256(f"{spec.kind}\0{int(keywords_only)}\0{spec.text}".encode()).digest()
        with self._lock:
            verdict = self._verdicts.get(key)
        shipped = None
        if verdict is None:
            verdict, shipped = await self._judge(spec, keywords_only)
            with self._lock:
                self._verdicts[key] = verdict
                while len(self._verdicts) > self._max_verdicts:
                    self._verdicts.popitem(last=False)
        if verdict:
            raise GrammarError(verdict)
        return shipped

    async def _judge(self, spec: GrammarSpec, keywords_only: bool) -> tuple[str, str | None]:
        """(the problem or "", the shipped result)."""
        budget = self.limits.timeout_s
        try:
            check_size(spec, self.limits)
            if keywords_only:
                shipped = await self.pool.call(f"{_TRIAL}:trial_schema", spec.text, timeout_s=budget)
            else:
                shipped = await self.pool.call(f"{_TRIAL}:trial_compile", spec.kind, spec.text, budget, self.ship,
                                               timeout_s=budget * 2 if self.ship else budget)
        except GrammarError as exc:
            return str(exc), None
        except CallTimeout:
            return too_slow(spec.kind, budget), None
        except CallFailed as exc:
            if exc.during_setup:
                raise  # ours, not the client's: no verdict
            return f"the grammar compiler failed on this {spec.kind.replace('_', ' ')}", None
        return "", shipped

    def close(self) -> None:
        self.pool.close()
