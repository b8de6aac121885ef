"""Offline API: `LLM(model_dir, **options).generate(prompts, sampling_params)`."""
from __future__ import annotations

from typing import Sequence

from .config import EngineConfig
from .engine import Engine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **options):
        self.engine = Engine(EngineConfig(model_dir=model), **options)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _optional_tokenizer(self):
        try:
            return self.tokenizer
        except (OSError, ValueError):
            return None

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        rids = []
        for p, sp in zip(prompts, params):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            rids.append(self.engine.add_request(ids, sp))
        results = {rid: {"ids": [], "lps": [], "tops": [], "reason": None, "stop": None, "text": None,
                         "cached": 0} for rid in rids}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(rids), desc="generate", unit="req")
        try:
            while self.engine.has_work:
                for out in self.engine.step():
                    r = results[out.rid]
                    r["ids"].extend(out.token_ids)
                    r["lps"].extend(out.logprobs)
                    r["tops"].extend(out.top_logprobs)
                    r["cached"] = out.num_cached_tokens
                    if out.text is not None:
                        r["text"] = out.text
                    if out.finished:
                        r["reason"], r["stop"] = out.finish_reason, out.stop_reason
                        if bar:
                            bar.update(1)
        except BaseException:
            for rid in rids:
                self.engine.abort(rid)
            raise
        finally:
            if bar:
                bar.close()
        outs = []
        for rid, p, sp in zip(rids, prompts, params):
            r = results[rid]
            text = r["text"]
            if text is None:  # token-id prompts on a folder without a tokenizer get no text
                tok = self.tokenizer if isinstance(p, str) else self._optional_tokenizer()
                text = tok.decode(r["ids"], skip_special_tokens=sp.skip_special_tokens) if tok else ""
            want_lp = sp.logprobs is not None
            outs.append(RequestOutput(
                rid=rid, prompt_token_ids=self.tokenizer.encode(p) if isinstance(p, str) else list(p),
                token_ids=r["ids"], text=text, finish_reason=r["reason"], stop_reason=r["stop"],
                logprobs=r["lps"] if want_lp else None, top_logprobs=r["tops"] if want_lp else None,
                num_cached_tokens=r["cached"]))
        return outs
