"""Speculative decoding: cheap proposers draft K tokens, the target model verifies them in
one forward of K + 1 positions, and rejection sampling keeps exactly the target's
distribution. Off unless EngineConfig.speculative_method is set (speculator.py)."""
