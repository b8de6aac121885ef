"""Quantized weights: which checkpoint formats the engine serves (config.py: FP8 block-wise,
per-channel and per-tensor, and refusals that name any other method) and how an FP8 weight
is sharded and held by the tensor-parallel layers (fp8_params.py)."""
