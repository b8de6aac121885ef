"""What a request asks of the serving path, decided once for every service (pure Python).

Modules (import them directly; this file stays free of imports):
  context_rule  prompt + max_tokens against the context length, OpenAI's message
  kv_demand     the KV pages a request can fill (prompt, max_tokens, n) and whether a pool holds them

The gateway (a 400 at once), the router (which decode worker has room), decode's Reserve and
the engine's request check all use these, so a request is judged the same everywhere.
"""
