"""KV page transfer between workers with NIXL (UCX backend), CPU or CUDA pools.

Modules (import them directly; this file stays free of imports):
  pool_info     PoolInfo: where a page-major KV pool lives (what a peer needs to write it)
  descriptors   merge page-id pairs into contiguous runs; build NIXL descriptor arrays
  notice        TransferNotice: the completion notice prefill sends to decode
  agent         KvTransferAgent: register the pool once, peers, write_pages, notifications
  write_stream  PageWriteStream: one reservation's writes on one rank + its final notice
"""
