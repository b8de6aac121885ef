"""Engine settings: one dataclass, filled by the offline API, the CLI and the workers.

Each field is declared once with its flag and DUET_* variable (shared/settings): `duet worker`
takes them all (`--help` lists them but the internal ones), a worker's WorkerConfig holds one
of these, and `duet env` prints the variables. Values given in code are parsed and checked by
the same declarations (__post_init__), so the engine receives typed values. What the engine
then runs (kernels, graphs, overlap, PDL, all-reduce, tiers) is resolved once from these, the
device and the model into an EnginePlan (plan.py, plan_resolve.py). Adding a setting is one
field here. No torch import at module level: `duet worker --help` and `duet env` read this file."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from shared.settings import parsers
from shared.settings.spec import check_values, nested, setting

from .grammar_limits import GrammarLimits
from .kv_write_policy import HostTierWrites
from .lora.config import LoraConfig
from .tenant_quota import TenantQuota

if TYPE_CHECKING:
    import torch

    from .parallel.context import TPContext

CPU_DEFAULT_KV_BYTES = 1 << 30  # absolute on CPU: several workers share one small machine


def _tp_context() -> TPContext:
    from .parallel.context import TPContext
    return TPContext()


@dataclass
class EngineConfig:
    model_dir: str | None = setting(
        None, flag="--model", env="DUET_MODEL", help="HF model folder (default: the embedded SmolLM2-135M)")
    dtype: str = setting(
        "auto", flag="--dtype", env="DUET_DTYPE", choices=("auto", "float32", "bfloat16", "float16", "float64"),
        help="weights and KV dtype (auto: float32 on CPU, bfloat16 on GPU; float64: CPU only, for tests)")
    device: str = setting("auto", flag="--device", env="DUET_DEVICE", help="auto | cpu | cuda | cuda:N")
    page_size: int = setting(16, flag="--page-size", env="DUET_PAGE_SIZE", help="tokens per KV page")
    kv_cache_memory: int | None = setting(
        None, flag="--kv-cache-memory", env="DUET_KV_CACHE_MEMORY", parse=parsers.optional_size,
        help="KV budget in bytes, e.g. 512M or 4G (default: 1G on CPU, --mem-fraction on GPU)")
    # host-memory tier under the device KV pool (kv_host_tier.py), bytes; None: on a GPU
    # twice the device KV budget, at most a quarter of the host's available memory; off on
    # the CPU (its device pool is host memory already); 0: off
    kv_host_memory: int | None = setting(
        None, flag="--kv-host-memory", env="DUET_KV_HOST_MEMORY", parse=parsers.size,
        help="host-memory KV tier under the device pool, e.g. 16G, for the whole worker (a TP worker's ranks "
             "each hold their share); 0 = off (default: on a GPU twice the device KV budget, at most a quarter "
             "of the host's available memory; off on the CPU)")
    mem_fraction: float = setting(
        0.85, flag="--mem-fraction", env="DUET_MEM_FRACTION",
        help="GPU: share of total memory for weights + KV (+ graphs)")
    max_num_batched_tokens: int | None = setting(
        None, flag="--max-num-batched-tokens", env="DUET_MAX_BATCHED_TOKENS", parse=parsers.optional_int,
        help="per-step token budget, chunked prefill (default: 8192 on GPU, 1024 on CPU)")
    max_running_requests: int = setting(
        256, flag="--max-running-requests", env="DUET_MAX_RUNNING", help="requests in the running batch at most")
    max_model_len: int | None = setting(
        None, flag="--max-model-len", env="DUET_MAX_MODEL_LEN", parse=parsers.optional_int,
        help="context length (default and upper bound: the model's)")
    enable_prefix_cache: bool = setting(
        True, flag="--prefix-cache", env="DUET_PREFIX_CACHE", off_flags=("--disable-prefix-cache",),
        help="share the KV pages of common prompt prefixes (radix cache)")
    attention_backend: str = setting(
        "auto", flag="--attention-backend", env="DUET_ATTENTION_BACKEND",
        choices=("auto", "torch", "triton", "flashinfer"),
        help="attention kernels (auto: triton on a GPU, torch on the CPU; flashinfer when installed)")
    cuda_graph: bool = setting(
        True, flag="--cuda-graph", env="DUET_CUDA_GRAPH", off_flags=("--disable-cuda-graph",),
        help="decode through captured CUDA graphs (GPU)")
    cuda_graph_max_bs: int = setting(
        256, flag="--cuda-graph-max-bs", env="DUET_CUDA_GRAPH_MAX_BS",
        help="largest decode batch captured as a CUDA graph; larger batches run eagerly")
    prefill_graph_max_tokens: int = setting(
        512, flag="--prefill-graph-max-tokens", env="DUET_PREFILL_GRAPH_MAX_TOKENS",
        help="steps with prefill of up to this many tokens in all (a conversation's next turn, a short "
             "prompt, a prompt's chunk beside the running streams' decode rows) replay CUDA graphs "
             "captured per token bucket; 0 = eager")
    # CPU prepares step N+1 while the device runs step N (overlap.py). None: on, except with
    # TP on GPUs without the custom all-reduce (the tokens would need an NCCL broadcast a step);
    # with it rank 0 pushes the tokens on the device and overlap pays as on one GPU
    overlap_schedule: bool | None = setting(
        None, flag="--overlap-schedule", env="DUET_OVERLAP_SCHEDULE", parse=parsers.boolean,
        help="prepare step N+1 on the CPU while the device runs step N (default on, except with --tp > 1 "
             "on GPUs without the custom all-reduce)")
    num_threads: int | None = setting(
        None, flag="--threads", env="DUET_THREADS", parse=parsers.optional_int, help="torch intra-op threads (CPU)")
    tp_size: int = setting(
        1, flag="--tp", env="DUET_TP", help="tensor-parallel ranks (one process each; this process is rank 0)")
    ep_size: int = setting(
        1, flag="--ep", env="DUET_EP",
        help="MoE models: expert-parallel size, 1 (every expert sliced over the TP ranks) or --tp (each rank "
             "holds 1/ep of the experts whole)")
    custom_all_reduce: bool = setting(
        True, flag="--custom-all-reduce", env="DUET_CUSTOM_ALL_REDUCE",
        help="TP on GPU: one-shot P2P all-reduce fused with add+RMSNorm instead of NCCL")
    # internal (kept for comparisons; docs/performance/tp.md): fused: one launch that
    # pushes, signals with in-kernel flags, sums and does add+RMSNorm; barrier: the same sum
    # between two torch symm-mem barriers; oneshot: torch's one-launch copy+sync+sum, then
    # add+RMSNorm (custom_all_reduce.py)
    custom_all_reduce_mode: str = setting(
        "fused", flag="--custom-all-reduce-mode", env="DUET_CUSTOM_ALLREDUCE", env_in_code=True, internal=True,
        choices=("fused", "barrier", "oneshot"), help="kernel of the custom all-reduce")
    # decode-size linears (<= 16 rows, bf16/fp16, GPU) through the split-K Triton kernel
    # (kernels/small_batch_linear.py) instead of cuBLAS: "auto" (default: the LM head, which it
    # won on every GPU swept, and every linear whose shape and batch this GPU's sweep tuned, i.e.
    # where it beat cuBLAS), "lm_head", "all", or "off"
    small_batch_linear: str = setting(
        "auto", flag="--small-batch-linear", env="DUET_SMALL_BATCH_LINEAR", env_in_code=True,
        choices=("auto", "lm_head", "all", "off"),
        help="decode-size linears through our split-K GEMV instead of cuBLAS (auto: the LM head and "
             "each linear this GPU's sweep tuned)")
    # programmatic dependent launch for the decode kernels (kernels/pdl.py; Hopper+): batch 1,
    # and more rows where measured to pay (MAX_ROWS); "on" (default; where the GPU and Triton
    # have it) or "off"
    pdl: str = setting(
        "on", flag="--pdl", env="DUET_PDL", env_in_code=True, choices=("on", "off"),
        help="programmatic dependent launch for the decode kernels (Hopper): batch 1, and on one GPU up to 32 "
             "rows for FP8 models, 2 for 16-bit MoE ones")
    # internal, for the PDL benchmarks (docs/performance/pdl.md): the
    # small-batch linears prefetch this many weight tiles into L2 while the kernel before them
    # finishes; measured not to pay once the short kernels wait before they signal
    pdl_prefetch_k_blocks: int = setting(
        0, flag="--pdl-prefetch", env="DUET_PDL_PREFETCH", env_in_code=True, internal=True,
        help="weight tiles a decode linear pulls into L2 before it waits on the kernel before it (0: none; "
             "since the short kernels wait before they signal, a prefetch only competes)")
    pdl_prefetch_at: dict[str, int] = setting(
        {}, flag="--pdl-prefetch-at", env="DUET_PDL_PREFETCH_AT", env_in_code=True, internal=True,
        parse=parsers.name_counts,
        help='per-linear depths that replace --pdl-prefetch, by attribute name: "o_proj=8,qkv_proj=2"')
    grammar_cache_size: int = setting(
        256, flag="--grammar-cache-size", env="DUET_GRAMMAR_CACHE_SIZE",
        help="compiled grammars (JSON schemas, tool calls) kept per worker; a request whose grammar "
             "was evicted compiles it again")
    # what one request's grammar may cost (the gateway reads the same settings)
    grammar: GrammarLimits = nested(GrammarLimits)
    # per-tenant KV quotas: cached pages evicted first, live pages admitted last (tenant_quota.py)
    tenant_quota: TenantQuota = nested(TenantQuota, "tenant KV quotas")
    # what is written back to the host KV tier, how fast (kv_write_policy.py, kv_write_back.py)
    host_writes: HostTierWrites = nested(HostTierWrites, "host KV tier write-back")
    load_format: str = setting(
        "auto", flag="--load-format", env="DUET_LOAD_FORMAT", choices=("auto", "dummy"),
        help="dummy: random weights drawn on the device from a fixed seed instead of the folder's safetensors "
             "(benchmarks of real shapes; every worker of one TP size and device type draws the same weights)")
    # FP8 (shared/engine/quantization): an FP8 checkpoint is served in FP8 either way; "fp8" also
    # quantizes a 16-bit one block-wise at load. On the CPU FP8 weights are dequantized at load.
    quantization: str = setting(
        "none", flag="--quantization", env="DUET_QUANTIZATION", choices=("none", "fp8"),
        help="fp8: quantize a 16-bit checkpoint's linear layers to FP8 (128x128 blocks) at load; an FP8 "
             "checkpoint (quantization_config fp8 / compressed-tensors float8) is served in FP8 without it")
    # FP8 linears of 2..32 rows on Hopper (kernels/fp8_decode_gemm.py): "on" quantizes the
    # activations per token per 128 columns inside the GEMM (W8A8, as prefill and as SGLang and
    # vLLM run block FP8), "off" widens the weights instead (W8A16: slower, no activation rounding)
    fp8_decode_gemm: str = setting(
        "on", flag="--fp8-decode-gemm", env="DUET_FP8_DECODE_GEMM", choices=("on", "off"),
        help="FP8 linears of 2..32 rows on Hopper: on = activations quantized to FP8 inside the GEMM (W8A8, "
             "faster); off = the weights widened to 16 bits (W8A16, no activation "
             "rounding)")
    kv_cache_dtype: str = setting(
        "auto", flag="--kv-cache-dtype", env="DUET_KV_CACHE_DTYPE", choices=("auto", "fp8_e4m3"),
        help="KV cache dtype: auto (the weights' dtype) or fp8_e4m3 (half a bf16 cache's bytes per token and "
             "per handoff; scaled by the checkpoint's k_scale/v_scale, else 1.0); prefill and decode pair "
             "only with the same")
    # speculative decoding (shared/engine/speculative/): off (None), "ngram" (drafts copied
    # from the request's own tokens), "draft" (a smaller model with the target's tokenizer)
    # or "eagle3" (an EAGLE-3 head over the target's hidden states)
    speculative_method: str | None = setting(
        None, flag="--speculative-method", env="DUET_SPECULATIVE_METHOD", choices=("ngram", "draft", "eagle3"),
        help="speculative decoding: ngram (prompt lookup), draft (a smaller model, --speculative-draft-model) "
             "or eagle3 (an EAGLE-3 head, --speculative-draft-model); off by default")
    speculative_tokens: int = setting(
        4, flag="--speculative-tokens", env="DUET_SPECULATIVE_TOKENS",
        help="draft tokens per verify step (K; the target computes K + 1 positions a sequence)")
    speculative_draft_model: str | None = setting(
        None, flag="--speculative-draft-model", env="DUET_SPECULATIVE_DRAFT_MODEL",
        help="folder of the draft model (same tokenizer as the target, any architecture the engine loads) "
             "or of the EAGLE-3 head")
    # n-gram lookup: the longest suffix of max..min tokens that occurred before proposes
    # what followed it
    speculative_ngram_min: int = setting(
        2, flag="--speculative-ngram-min", env="DUET_SPECULATIVE_NGRAM_MIN",
        help="n-gram lookup: shortest suffix that may match")
    speculative_ngram_max: int = setting(
        4, flag="--speculative-ngram-max", env="DUET_SPECULATIVE_NGRAM_MAX",
        help="n-gram lookup: longest suffix tried (the longest match wins)")
    # step aside: no speculation above this many decoding sequences (None: the measured
    # default, speculative/policy.py), nor for a request whose recent accepted tokens per
    # draft token fall below the threshold (it tries again after a cool-down)
    speculative_max_batch: int | None = setting(
        None, flag="--speculative-max-batch", env="DUET_SPECULATIVE_MAX_BATCH", parse=parsers.optional_int,
        help="decode plainly above this many decoding sequences (default: the measured crossover)")
    speculative_min_acceptance: float = setting(
        0.2, flag="--speculative-min-acceptance", env="DUET_SPECULATIVE_MIN_ACCEPTANCE",
        help="a request whose recent drafts are accepted below this share sits speculation out for a while")
    # LoRA adapters served beside the base model (shared/engine/lora/)
    lora: LoraConfig = nested(LoraConfig, "LoRA adapters")
    # benchmarks only, no flag (never served): every draft token counts as accepted, whatever
    # the target says; gives the bound of a method's speed-up
    speculative_accept_all: bool = False
    # no flag: False on a prefill worker (its role says so), which stops every request at its
    # first token: no decode graphs captured, no decode steps warmed up
    runs_decode: bool = True
    tp: TPContext = field(default_factory=_tp_context)  # this process's rank (set by the engine)

    def __post_init__(self):
        check_values(self)  # text given in code parsed as a flag's, choices enforced

    def with_options(self, **options) -> EngineConfig:
        """A copy with these fields replaced, checked as flags are (`tp=N` names tp_size, as in
        `LLM(model, tp=2)`); TypeError for a name that is no option."""
        if isinstance(options.get("tp"), int):
            options["tp_size"] = options.pop("tp")
        names = {f.name for f in fields(self)}
        for name in options:
            if name not in names:
                raise TypeError(f"unknown engine option {name!r}")
        return replace(self, **options) if options else self

    def resolve_device(self) -> torch.device:
        """The device this rank runs on (rank r of a TP worker takes the r-th GPU from the given one)."""
        import torch
        if self.device == "auto":
            dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            dev = torch.device(self.device)
        if dev.type == "cuda":  # an explicit index (set_device needs one); rank r takes the r-th GPU
            dev = torch.device("cuda", (dev.index or 0) + self.tp.rank)
        return dev
