"""Offline commands over the engine's LLM API: `duet generate` and `duet chat`.

Modules (import them directly; this file stays free of imports):
  options   the flags both share (model, device, sampling), logging, loading the model
  generate  `duet generate`: complete one raw prompt
  chat      `duet chat`: an interactive multi-turn chat
"""
