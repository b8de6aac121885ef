"""What an engine runs, decided once at start: the EnginePlan.

Every choice a worker makes before its first step (which kernels, CUDA graphs or not, overlap
scheduling, PDL, the all-reduce, the FP8 paths, the host KV tier, attention, KV dtype,
speculation) is resolved from the settings (config.py), the device, the model's config and
the parallel setup by plan_resolve.py, into this frozen object, each choice with a short
reason. The engine builds its parts from it (engine.py, engine_parts.py), logs `render()` in
one line at start, and `duet env --plan` prints `explain()` for this machine without loading
weights. The same idea as vLLM's VllmConfig and SGLang's ServerArgs post-init, which resolve
such choices once; here the settings stay as given and the outcome is a separate object.

No torch import: the plan is data (dtype names, not torch dtypes)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from kernels.pdl import Pdl

T = TypeVar("T")


@dataclass(frozen=True)
class Decision(Generic[T]):
    """One choice: the value the engine uses, how the one-line rendering spells it (no spaces),
    and why it came out so."""

    value: T
    shown: str
    why: str


@dataclass(frozen=True)
class DeviceFacts:
    """What the resolver needs to know about the device (plan_resolve.probe_device reads them)."""

    type: str                      # "cpu" | "cuda"
    index: int | None = None
    name: str = "cpu"              # "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int] | None = None
    triton: bool = False           # the Triton kernels run here (a CUDA device and triton)
    pdl: bool = False              # programmatic dependent launch (sm90+ and a Triton that has it)
    tma: bool = False              # Hopper with TMA: the FP8 decode GEMM runs
    host_available: int = 0        # host memory this process may still take, bytes

    @property
    def label(self) -> str:
        if self.type != "cuda":
            return self.type
        short = self.name.removeprefix("NVIDIA ").replace(" ", "_")
        sm = f",sm{self.capability[0]}{self.capability[1]}" if self.capability else ""
        return f"cuda:{self.index or 0}({short}{sm})"


@dataclass(frozen=True)
class PdlPlan:
    pdl: Pdl
    prefetch_at: tuple[tuple[str, int], ...] = ()  # per-linear prefetch depths (internal knob)


@dataclass(frozen=True)
class DecodeGraphs:
    sizes: tuple[int, ...]  # the batch ladder decode steps pad up to
    capture: bool           # replay captured graphs (False: the same padded kernels, launched eagerly)


@dataclass(frozen=True)
class HostTier:
    budget: int | None  # bytes for the whole worker; None: twice the device KV budget, at most `cap`
    cap: int = 0


@dataclass(frozen=True)
class LoraPlan:
    slots: int    # adapters one step mixes (device slots)
    rank: int     # every slot's rank (smaller adapters zero-padded)
    triton: bool  # the Triton kernels (kernels/lora.py), else the torch references


@dataclass(frozen=True)
class EnginePlan:
    device: Decision[str]                    # torch device string, "cuda:1" / "cpu"
    tp: Decision[int]                        # tensor-parallel size
    dtype: Decision[str]                     # torch dtype name of weights and activations
    weights: Decision[str]                   # "fp8" (FP8 kernels), or the dtype they load in
    kernels: Decision[bool]                  # the fused Triton kernels (norms, RoPE, MoE, ...)
    attention: Decision[str]                 # attention backend name
    kv_dtype: Decision[str]                  # KV pool dtype name
    linears: Decision[str | None]            # small-batch linear mode (auto/lm_head/all), None: cuBLAS
    fp8_decode_gemm: Decision[int]           # rows up to which FP8 linears take the W8A8 decode GEMM; 0: off
    pdl: Decision[PdlPlan | None]
    custom_all_reduce: Decision[str | None]  # its mode, None: NCCL/gloo or no TP
    decode_graphs: Decision[DecodeGraphs | None]  # None: no graph runner (CPU, a backend without hooks)
    prefill_graphs: Decision[int]            # largest prefill step replayed from a graph, tokens; 0: eager
    overlap: Decision[bool]
    host_tier: Decision[HostTier | None]
    speculative: Decision[str | None]        # method on this rank, None: off
    lora: Decision[LoraPlan | None]          # LoRA adapter slots (shared/engine/lora/), None: off
    max_model_len: Decision[int]
    step_tokens: Decision[int]               # per-step token budget (chunked prefill)
    facts: DeviceFacts | None = None         # what the device looked like when resolved

    def choices(self) -> list[tuple[str, Decision[Any]]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "facts"]

    def render(self) -> str:
        """One line, `key=value` for every choice (the engine's start-up log line)."""
        return " ".join(f"{name}={d.shown}" for name, d in self.choices())

    def explain(self) -> str:
        """One line a choice with its reason (`duet env --plan`)."""
        width = max(len(d.shown) for _, d in self.choices())
        return "\n".join(f"{name:<18}{d.shown:<{width + 2}}{d.why}" for name, d in self.choices())

    def as_dict(self) -> dict[str, dict[str, str]]:
        return {name: {"value": d.shown, "why": d.why} for name, d in self.choices()}
