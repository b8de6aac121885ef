"""Tensor parallelism: one process per rank on one host.

Modules (import them directly; this file stays free of imports):
  context           TPContext (this rank, the all-reduce the layers call), kv_head_slice
  launcher          rank 0 starts ranks 1..N-1 and drives them (TPWorkers)
  follower          ranks 1..N-1: build the same Engine, then run every step rank 0 sends
  control           the control pipe's message kinds and the process-group setup both sides share
  custom_all_reduce the one-shot all-reduce over peer-mapped GPU buffers (kernels/triton_peer_*)

The launcher never imports the engine (the engine imports it); the follower does.
"""
