"""KV page transfer between workers with NIXL (UCX backend), CPU or CUDA pools.

Modules (import them directly; this file stays free of imports):
  pool_info     PoolInfo: where a page-major KV pool lives (what a peer needs to write it)
  descriptors   merge page-id pairs into contiguous runs; build NIXL descriptor arrays
  notice        TransferNotice: the completion notice prefill sends to decode (MACed)
  capability    the write capability decode signs with each reservation; prefill verifies it
  agent         KvTransferAgent: register the pool once, peers, write_pages, notifications
  write_stream  PageWriteStream: one reservation's writes on one rank + its final notice
  head_plan     which prefill rank writes which KV heads into which decode rank (TP sizes differ)
  rank_transfers, tp_write_stream   the same on tensor-parallel ranks, driven by rank 0

How a handoff goes from reservation to completion notice: docs/ARCHITECTURE.md, "The KV handoff".
"""
