"""Duet's model engine: paged KV, prefix cache, continuous batching, chunked prefill.

The public names are loaded lazily so `import shared.engine` stays cheap (no torch import)."""

__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig", "RequestOutput"]


def __getattr__(name):
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "SamplingParams":
        from .sampling_params import SamplingParams
        return SamplingParams
    if name == "Engine":
        from .engine import Engine
        return Engine
    if name == "EngineConfig":
        from .config import EngineConfig
        return EngineConfig
    if name == "RequestOutput":
        from .outputs import RequestOutput
        return RequestOutput
    raise AttributeError(name)
