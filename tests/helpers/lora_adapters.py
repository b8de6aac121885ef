"""Random-weight LoRA adapters saved by PEFT itself, and transformers + PEFT references.

`save_random_adapter` wraps a model folder's model with peft's LoraConfig (every target the
engine serves unless told otherwise) and init_lora_weights=False, so A and B are both drawn
(PEFT's default leaves B zero: an adapter that changes nothing), seeded, then saves it with
`save_pretrained` (adapter_config.json + adapter_model.safetensors). `merged_greedy` loads the
base model, applies the adapter with PeftModel and merges it (W + scale B A), then decodes
greedily: the text the engine must give with the adapter."""
from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_random_adapter(base_dir: Path, out_dir: Path, rank: int = 8, seed: int = 0, alpha: int | None = None,
                        targets: tuple[str, ...] = ALL_TARGETS, scale_b: float = 1.0) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets), lora_dropout=0.0,
                     bias="none", init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    if scale_b != 1.0:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale_b)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged_model(base_dir: Path, adapter_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' model with the PEFT adapter merged into its weights."""
    from peft import PeftModel
    from tests.helpers.engine_models import load_hf
    return PeftModel.from_pretrained(load_hf(base_dir, dtype), str(adapter_dir)).merge_and_unload().eval()
