"""The `lora` section of `duet bench`: decode steps and prefill with LoRA adapters in the batch,
against the base model on the same engine and on one without LoRA, on the last --models shape.
Adapters are random, rank --lora-rank on every linear the engine adapts, written in PEFT's format
from the model's shapes (no base model is loaded to make them)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .measure import decode_step_ms, prefill_rate, with_engine

ADAPTER_COUNTS = (0, 1, 8)  # distinct adapters in one batch (0: every row on the base model)


def random_adapter(folder: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) adapting every target module."""
    from safetensors.torch import save_file

    from shared.engine.lora.targets import TARGETS, module_shape

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, target in TARGETS.items():
            n_in, n_out = module_shape(cfg, module)
            key = f"base_model.model.model.layers.{layer}.{target.block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 1e-3
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(TARGETS),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))
    return folder


def lora(run) -> None:
    """Step ms at each batch with 0 / 1 / 8 adapters (rows spread over them round robin) and prefill
    tokens/s the same way, each against the base step of an engine without LoRA."""
    from shared.engine.lora.config import LoraConfig

    args, name = run.args, run.names(run.args.models)[-1]
    batches, rank = run.ints(args.batches), args.lora_rank
    prompts = max(run.ints(args.prefill_prompts))
    base: dict = {}
    common = dict(max_model_len=max(4096, 2 * args.ctx), cuda_graph_max_bs=max(batches))

    def plain(eng):
        for b in batches:
            base[b] = decode_step_ms(eng, b, args.ctx, args.steps, overlap=True)
            run.add("lora", f"{name} no LoRA B={b} step_ms", base[b])
        base["prefill"] = prefill_rate(eng, prompts, args.prefill_len)["tok_s"]
        run.add("lora", f"{name} no LoRA prefill {prompts}x{args.prefill_len} tok_s", round(base["prefill"]))

    def adapted(eng):
        names = [f"r{rank}-{i}" for i in range(max(ADAPTER_COUNTS))]
        for i, n in enumerate(names):
            eng.lora.load(n, str(random_adapter(run.root / "lora" / n, eng.model_config, rank, seed=i)))
        for count in ADAPTER_COUNTS:
            use = tuple(names[:count])
            for b in batches:
                ms = decode_step_ms(eng, b, args.ctx, args.steps, overlap=True, adapters=use)
                run.add("lora", f"{name} {count} adapters B={b} step_ms", ms, f"x{ms / base[b]:.3f} of no LoRA")
            tok_s = prefill_rate(eng, prompts, args.prefill_len, adapters=use)["tok_s"]
            run.add("lora", f"{name} {count} adapters prefill tok_s", round(tok_s),
                    f"x{base['prefill'] / tok_s:.3f} the time of no LoRA")

    with_engine(run, name, plain, **common)
    slots = max(ADAPTER_COUNTS)
    with_engine(run, name, adapted, lora=LoraConfig(max_loras=slots, max_cpu_loras=slots, max_lora_rank=rank), **common)
