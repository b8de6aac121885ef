"""Redis worker registry: workers publish themselves, routers/gateways/decoders watch.

Modules (import them directly; this file stays free of imports):
  config         RegistryConfig (--redis-url / DUET_REDIS_URL, TTL, heartbeat)
  keys           RegistryKeys: key and channel names
  worker_info    WorkerInfo, WorkerLoad, RankKvPool and their Redis hash encoding
  publisher      WorkerPublisher (asyncio) and HeartbeatThread (for sync loops)
  watcher        WorkerWatcher: live worker set, survives short Redis outages
  peers          read a worker's NIXL metadata (sync and async)
  prefix_hashes  chained page hashes of a prompt (gateway, router, engine agree on them)
  kv_events      KvEventBuffer: which page hashes a prefill worker holds
"""
