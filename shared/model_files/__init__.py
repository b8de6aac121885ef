"""Model files on disk: the embedded default model and its GGUF conversion.

Modules (import them directly; this file stays free of imports):
  default_model  resolve_model_dir (a local HF folder, or the default model converted once
                 into the cache), ensure_default_model, `duet convert-default-model`
  gguf_convert   a llama-architecture GGUF file -> a Hugging Face model folder
"""
