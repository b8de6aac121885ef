"""LoRA adapters served beside the base model in one batch (docs/ARCHITECTURE.md, "LoRA adapters").

config.py: the settings; adapter_files.py: reading and checking a PEFT adapter folder;
targets.py: which of the model's linears a PEFT module name adapts; layer.py: the device slots
of one linear and the hook that adds each row's update; manager.py: which adapters are known,
which sit in host memory and which in the device's slots (least recently used out)."""
