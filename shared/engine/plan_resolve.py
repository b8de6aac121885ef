"""EnginePlan from the settings, the device, the model's config and the parallel setup
(plan.py says what the plan is). Each `_choice` function below decides one field and says why;
nothing here loads weights or allocates device memory, so `duet env --plan` resolves the plan
of this machine from the model's config.json alone. The engine calls resolve_plan once, and
again with `custom_all_reduce_failed` where the ranks could not set that all-reduce up (the
graph and overlap choices that depend on it follow)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .config import EngineConfig
from .model_config import ModelConfig
from .plan import Decision, DecodeGraphs, DeviceFacts, EnginePlan, HostTier, LoraPlan, PdlPlan

if TYPE_CHECKING:
    import torch

GIB = 1 << 30
LINEAR_NAMES = {"lm_head": "lm_head", "qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up",
                "down_proj": "down"}


def resolve_plan(config: EngineConfig, mc: ModelConfig, facts: DeviceFacts,
                 custom_all_reduce_failed: str = "") -> EnginePlan:
    """Every start-time choice of an engine of `config` for model `mc` on the device of `facts`
    (this rank's: config.tp.rank, of config.tp_size). Raises ValueError for a combination that
    cannot run (a split the model does not divide into, a backend the device lacks, ...)."""
    _check_parallel(config, mc)
    dtype = _dtype(config, facts)
    kernels = _kernels(facts)
    weights = _weights(mc, dtype.value, kernels.value)
    kv_dtype = _kv_dtype(config, dtype.value)
    attention = _attention(config, facts, kv_dtype.value)
    car = _custom_all_reduce(config, facts, custom_all_reduce_failed)
    decode_graphs = _decode_graphs(config, facts, attention.value, car.value)
    max_model_len = _max_model_len(config, mc)
    step_tokens = _step_tokens(config, facts)
    return EnginePlan(
        device=_device(config, facts), tp=_tp(config), dtype=dtype, weights=weights, kernels=kernels,
        attention=attention, kv_dtype=kv_dtype,
        linears=_linears(config, mc, facts, dtype.value, kernels.value, weights.value),
        fp8_decode_gemm=_fp8_decode_gemm(config, facts, weights.value),
        pdl=_pdl(config, mc, facts, kernels.value, weights.value),
        custom_all_reduce=car, decode_graphs=_for_the_role(config, decode_graphs),
        prefill_graphs=_prefill_graphs(config, decode_graphs.value, step_tokens.value, max_model_len.value),
        overlap=_overlap(config, facts, car.value), host_tier=_host_tier(config, facts),
        speculative=_speculative(config), lora=_lora(config, kernels.value, facts), max_model_len=max_model_len,
        step_tokens=step_tokens, facts=facts)


def plan_for(config: EngineConfig) -> EnginePlan:
    """The plan an engine of `config` would run on this machine, from the model's config.json
    (the embedded default model when config.model_dir is None): no weights loaded."""
    from shared.model_files.default_model import resolve_model_dir
    mc = ModelConfig.from_dir(resolve_model_dir(config.model_dir), quantization=config.quantization)
    return resolve_plan(config, mc, probe_device(config.resolve_device()))


def probe_device(device: torch.device) -> DeviceFacts:
    """What `device` offers the engine: Triton, PDL, TMA, its name and capability."""
    host = available_host_memory()
    if device.type != "cuda":
        return DeviceFacts(type=device.type, host_available=host)
    import torch
    if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device}: no such CUDA device here")
    from kernels.availability import triton_available
    from kernels.fp8_decode_gemm import hopper_with_tma
    from kernels.pdl import pdl_supported
    index = device.index or 0
    triton = triton_available()
    return DeviceFacts(type="cuda", index=index, name=torch.cuda.get_device_name(index),
                       capability=tuple(torch.cuda.get_device_capability(index)), triton=triton,
                       pdl=triton and pdl_supported(device), tma=triton and hopper_with_tma(index),
                       host_available=host)


def available_host_memory() -> int:
    """What this process may still take: MemAvailable, and within a container (a pod) what
    its cgroup limit leaves, in bytes."""
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            used = int(open("/sys/fs/cgroup/memory.current").read())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(avail, 0)


# -- one function a choice ----------------------------------------------------------------------

def _check_parallel(config: EngineConfig, mc: ModelConfig) -> None:
    if config.ep_size not in (1, config.tp_size):
        raise ValueError(f"expert-parallel size {config.ep_size} must be 1 or the tensor-parallel "
                         f"size ({config.tp_size}): experts are split over the same ranks")
    if config.ep_size > 1 and not mc.is_moe:
        raise ValueError(f"expert parallelism (ep {config.ep_size}) needs a mixture-of-experts model; "
                         f"{mc.architecture} is dense")
    if config.tp_size > 1:
        from .parallel.launcher import check_divisible
        check_divisible(mc, config.tp_size, expert_parallel=config.ep_size > 1)


def _device(config: EngineConfig, facts: DeviceFacts) -> Decision[str]:
    name = "cpu" if facts.type != "cuda" else f"cuda:{facts.index or 0}"
    if config.device == "auto":
        why = "auto: a CUDA device" if facts.type == "cuda" else "auto: no CUDA device"
    else:
        why = f"--device {config.device}"
    if facts.type == "cuda" and config.tp.rank:
        why += f", offset by rank {config.tp.rank}"
    return Decision(name, facts.label, why)


def _tp(config: EngineConfig) -> Decision[int]:
    size, rank = config.tp_size, config.tp.rank
    if size == 1:
        return Decision(1, "1", "one process")
    experts = ", each rank holds whole experts" if config.ep_size > 1 else ""
    return Decision(size, f"{size}(rank{rank}{',ep' if config.ep_size > 1 else ''})",
                    f"--tp {size}: one process a rank, this is rank {rank}{experts}")


def _dtype(config: EngineConfig, facts: DeviceFacts) -> Decision[str]:
    if config.dtype == "auto":
        name = "bfloat16" if facts.type == "cuda" else "float32"
        return Decision(name, name, f"auto on {'a GPU' if facts.type == 'cuda' else 'the CPU'}")
    if config.dtype == "float64" and facts.type == "cuda":  # the Triton kernels have no fp64 variants
        raise ValueError("dtype float64 runs on the CPU only (device='cpu'); on a GPU choose float32, "
                         "bfloat16 or float16")
    return Decision(config.dtype, config.dtype, f"--dtype {config.dtype}")


def _kernels(facts: DeviceFacts) -> Decision[bool]:
    if facts.type == "cuda" and facts.triton:
        return Decision(True, "triton", "fused Triton kernels (norms, RoPE + KV store, MoE) on the GPU")
    why = "Triton is not importable here" if facts.type == "cuda" else "the CPU: torch ops"
    return Decision(False, "torch", why)


def _weights(mc: ModelConfig, dtype: str, fused: bool) -> Decision[str]:
    if mc.quant is None:
        return Decision(dtype, dtype, "as the engine's dtype")
    if fused:
        return Decision("fp8", "fp8", f"{mc.quant.describe()}, run by the FP8 kernels")
    return Decision(dtype, f"{dtype}(from-fp8)", f"{mc.quant.describe()}, dequantized at load: no FP8 kernels here")


def _kv_dtype(config: EngineConfig, dtype: str) -> Decision[str]:
    if config.kv_cache_dtype == "fp8_e4m3":
        return Decision("float8_e4m3fn", "fp8_e4m3", "--kv-cache-dtype fp8_e4m3, scaled by the checkpoint's "
                        "k_scale/v_scale")
    return Decision(dtype, dtype, "auto: the weights' dtype")


def _attention(config: EngineConfig, facts: DeviceFacts, kv_dtype: str) -> Decision[str]:
    name = config.attention_backend
    if name == "auto":
        name = "triton" if facts.type == "cuda" else "torch"
        return Decision(name, name, f"auto on {'a GPU' if facts.type == 'cuda' else 'the CPU'}")
    if name == "triton" and facts.type != "cuda":
        raise ValueError("the triton attention backend needs a CUDA device; use --attention-backend torch")
    if name == "flashinfer":
        if kv_dtype == "float8_e4m3fn":
            raise ValueError("the flashinfer attention backend does not read an FP8 KV cache here; use "
                             "--attention-backend triton (the GPU default) with --kv-cache-dtype fp8_e4m3")
        import importlib.util
        if importlib.util.find_spec("flashinfer") is None:
            raise ValueError("attention backend 'flashinfer' needs the flashinfer package")
    return Decision(name, name, f"--attention-backend {name}")


def _linears(config: EngineConfig, mc: ModelConfig, facts: DeviceFacts, dtype: str, fused: bool,
             weights: str) -> Decision[str | None]:
    """The split-K small-batch kernel (kernels/small_batch_linear.py) or cuBLAS, per linear:
    shown as the rows of each that take the kernel."""
    mode = config.small_batch_linear
    if not fused:
        return Decision(None, "off", "no Triton kernels here")
    if mode == "off":
        return Decision(None, "off", "--small-batch-linear off: cuBLAS")
    if dtype not in ("bfloat16", "float16"):
        return Decision(None, "off", f"{dtype} weights: the kernel is for 16-bit ones")
    from kernels.small_batch_linear_config import M_BUCKETS, gpu_key, tuned_config
    gpu = gpu_key(facts.name)
    routes = [("lm_head", _row_ranges(M_BUCKETS))]
    for name, n, k, gate_up in _linear_shapes(mc, config.tp_size):
        if weights == "fp8":
            routes.append((name, "fp8"))
        elif mode == "lm_head":
            routes.append((name, "cuBLAS"))
        elif mode == "all":
            routes.append((name, _row_ranges(M_BUCKETS)))
        else:
            tuned = [b for b in M_BUCKETS if tuned_config(b, n, k, gpu, gate_up) is not None]
            routes.append((name, _row_ranges(tuned) or "cuBLAS"))
    shown = f"{mode}(" + ",".join(f"{LINEAR_NAMES[name]}:{rows}" for name, rows in routes) + ")"
    why = {"auto": f"the LM head, and each linear where the {gpu or 'untuned GPU'}'s sweep tuned its shape "
                   "(there it beat cuBLAS)",
           "lm_head": "--small-batch-linear lm_head", "all": "--small-batch-linear all"}[mode]
    return Decision(mode, shown, why + ("; FP8 linears by the FP8 kernels" if weights == "fp8" else ""))


def _linear_shapes(mc: ModelConfig, tp_size: int) -> list[tuple[str, int, int, bool]]:
    """(name, weight rows, columns, fused gate/up) of one rank's decoder linears."""
    from .parallel.context import kv_head_slice
    d, heads = mc.head_dim, mc.num_heads // tp_size
    kv = kv_head_slice(mc.num_kv_heads, tp_size, 0).count
    out = [("qkv_proj", (heads + 2 * kv) * d, mc.hidden_size, False), ("o_proj", mc.hidden_size, heads * d, False)]
    if mc.moe is None or len(mc.moe.sparse_layers) < mc.num_layers:  # some dense MLPs
        inter = mc.intermediate_size // tp_size
        out += [("gate_up_proj", 2 * inter, mc.hidden_size, True), ("down_proj", mc.hidden_size, inter, False)]
    return out


def _row_ranges(buckets) -> str:
    """Row buckets -> the rows they cover: (1, 2, 4, 8) -> "1-8"; (1, 8) -> "1+5-8"."""
    from kernels.small_batch_linear_config import M_BUCKETS
    spans: list[list[int]] = []
    for b in buckets:
        lo = ([0] + list(M_BUCKETS))[M_BUCKETS.index(b)] + 1
        if spans and spans[-1][1] == lo - 1:
            spans[-1][1] = b
        else:
            spans.append([lo, b])
    return "+".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)


def _fp8_decode_gemm(config: EngineConfig, facts: DeviceFacts, weights: str) -> Decision[int]:
    if weights != "fp8":
        return Decision(0, "off", "no FP8 weights on this device")
    if config.fp8_decode_gemm == "off":
        return Decision(0, "off", "--fp8-decode-gemm off: W8A16 small-batch kernel up to 32 rows")
    if not facts.tma:
        return Decision(0, "off", "needs Hopper with TMA: W8A16 small-batch kernel up to 32 rows")
    from kernels.fp8_decode_gemm import FP8_DECODE_MAX_M
    return Decision(FP8_DECODE_MAX_M, f"2-{FP8_DECODE_MAX_M}",
                    "W8A8 decode GEMM, activations quantized inside it (one row too where the small-batch "
                    "sweep has no tiling)")


def _pdl(config: EngineConfig, mc: ModelConfig, facts: DeviceFacts, fused: bool,
         weights: str) -> Decision[PdlPlan | None]:
    if config.pdl == "off":
        return Decision(None, "off", "--pdl off")
    if not fused or not facts.pdl:
        return Decision(None, "off", "needs a GPU of sm90+ and a Triton with PDL")
    from kernels.pdl import engine_pdl
    # how many rows take PDL depends on the model (kernels/pdl.py MAX_ROWS)
    pdl = engine_pdl(config.pdl_prefetch_k_blocks, "fp8" if weights == "fp8" else "16-bit",
                     "moe" if mc.moe is not None else "dense", config.tp_size)
    at = tuple(sorted(config.pdl_prefetch_at.items()))
    shown = f"rows<={pdl.max_rows}" + (f",prefetch{pdl.prefetch_k_blocks}" if pdl.prefetch_k_blocks else "")
    shown += "".join(f",{name}={depth}" for name, depth in at)
    why = "decode kernels launch while the one before finishes; rows by the model" + (
        " (one row under TP)" if config.tp_size > 1 else "")
    return Decision(PdlPlan(pdl, at), shown, why)


def _custom_all_reduce(config: EngineConfig, facts: DeviceFacts, failed: str) -> Decision[str | None]:
    if config.tp_size == 1:
        return Decision(None, "none", "one rank")
    if facts.type != "cuda":
        return Decision(None, "gloo", "CPU ranks")
    if not config.custom_all_reduce:
        return Decision(None, "nccl", "--no-custom-all-reduce")
    if failed:
        return Decision(None, "nccl", f"the custom all-reduce could not be set up: {failed}")
    mode = config.custom_all_reduce_mode
    return Decision(mode, f"custom-{mode}", "one-shot P2P all-reduce fused with add+RMSNorm")


def _decode_graphs(config: EngineConfig, facts: DeviceFacts, attention: str,
                   custom_all_reduce: str | None) -> Decision[DecodeGraphs | None]:
    if facts.type != "cuda":
        return Decision(None, "none", "the CPU")
    from .attention.select import backend_class
    if not backend_class(attention).supports_cuda_graph:
        return Decision(None, "none", f"the {attention} attention backend has no graph hooks")
    from .cuda_graph import batch_size_ladder
    sizes = tuple(batch_size_ladder(min(config.cuda_graph_max_bs, config.max_running_requests)))
    ladder = f"{sizes[0]}-{sizes[-1]}/{len(sizes)}"
    if not config.cuda_graph:
        return Decision(DecodeGraphs(sizes, False), f"eager({ladder})",
                        "--disable-cuda-graph: padded to the same sizes, launched one by one")
    if config.tp_size > 1 and custom_all_reduce is None:
        # NCCL collectives captured in decode graphs hung (a step never came); run those eagerly
        return Decision(DecodeGraphs(sizes, False), f"eager({ladder})",
                        "tensor parallel without the custom all-reduce: NCCL inside decode graphs hung")
    return Decision(DecodeGraphs(sizes, True), ladder,
                    f"decode steps pad up to {len(sizes)} captured batch sizes (--cuda-graph-max-bs)")


def _for_the_role(config: EngineConfig, graphs: Decision[DecodeGraphs | None]) -> Decision[DecodeGraphs | None]:
    """A prefill worker stops every request at its first token: it never runs a decode step,
    so it captures no decode graphs (its small prefill steps still replay theirs)."""
    if config.runs_decode or graphs.value is None:
        return graphs
    return Decision(None, "none", "a prefill worker runs no decode step")


def _prefill_graphs(config: EngineConfig, graphs: DecodeGraphs | None, step_tokens: int,
                    max_model_len: int) -> Decision[int]:
    if graphs is None or not graphs.capture:
        return Decision(0, "off", "no decode graphs")
    if config.prefill_graph_max_tokens <= 0:
        return Decision(0, "off", "--prefill-graph-max-tokens 0")
    tokens = min(config.prefill_graph_max_tokens, step_tokens, max_model_len)
    return Decision(tokens, f"<={tokens}", "small prefill steps, and prompts' chunks beside the decode rows, "
                    "replay graphs per token bucket")


def _overlap(config: EngineConfig, facts: DeviceFacts, custom_all_reduce: str | None) -> Decision[bool]:
    if config.overlap_schedule is not None:
        on = config.overlap_schedule
        return Decision(on, "on" if on else "off", "--overlap-schedule" if on else "--no-overlap-schedule")
    if config.tp_size > 1 and facts.type == "cuda" and custom_all_reduce is None:
        return Decision(False, "off", "TP on GPUs without the custom all-reduce: the sampled tokens would "
                        "need an NCCL broadcast a step")
    return Decision(True, "on", "default: the CPU prepares step N+1 while the device runs step N")


def _host_tier(config: EngineConfig, facts: DeviceFacts) -> Decision[HostTier | None]:
    budget = config.kv_host_memory
    if budget is None and facts.type != "cuda":
        return Decision(None, "off", "auto on the CPU: its pool is host memory already")
    if budget == 0:
        return Decision(None, "off", "--kv-host-memory 0")
    if not config.enable_prefix_cache:
        return Decision(None, "off", "the prefix cache is off")
    if budget is None:
        cap = facts.host_available // 4
        return Decision(HostTier(None, cap), f"2xKV<={cap / GIB:.1f}G",
                        "auto on a GPU: twice the device KV budget, at most a quarter of available host memory")
    return Decision(HostTier(budget), f"{budget / GIB:.1f}G", "--kv-host-memory, the worker's whole budget")


def _speculative(config: EngineConfig) -> Decision[str | None]:
    method = config.speculative_method
    if method is None:
        return Decision(None, "off", "no --speculative-method")
    if config.tp.rank:
        return Decision(None, "off", f"rank {config.tp.rank}: rank 0 drafts, every rank verifies")
    k = config.speculative_tokens
    return Decision(method, f"{method}(k={k})", f"--speculative-method {method}, {k} draft tokens a step")


def _lora(config: EngineConfig, fused: bool, facts: DeviceFacts) -> Decision[LoraPlan | None]:
    lora = config.lora
    if not lora.slots:
        return Decision(None, "off", "no --lora and no --max-loras")
    if facts.type == "cuda" and not fused:  # the references read the slots on the host: no graphs
        raise ValueError("LoRA on a GPU needs the Triton kernels (triton is not importable here)")
    how = "Triton kernels" if fused else "torch references"
    return Decision(LoraPlan(lora.slots, lora.max_lora_rank, fused), f"{lora.slots}x{lora.max_lora_rank}",
                    f"{lora.slots} adapter slots of rank {lora.max_lora_rank} ({how})")


def _max_model_len(config: EngineConfig, mc: ModelConfig) -> Decision[int]:
    most = mc.max_position_embeddings
    if config.max_model_len and config.max_model_len < most:
        return Decision(config.max_model_len, str(config.max_model_len), "--max-model-len")
    return Decision(most, str(most), "the model's max_position_embeddings")


def _step_tokens(config: EngineConfig, facts: DeviceFacts) -> Decision[int]:
    if config.max_num_batched_tokens:
        n = config.max_num_batched_tokens
        return Decision(n, str(n), "--max-num-batched-tokens")
    n = 8192 if facts.type == "cuda" else 1024
    return Decision(n, str(n), f"default on {'a GPU' if facts.type == 'cuda' else 'the CPU'}")
