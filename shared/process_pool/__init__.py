"""Helper processes whose calls have a hard time budget: work a request can make expensive
(chat templates, grammar compiles) runs there, never on a serving event loop, and a call past
its budget kills the process (a thread cannot be stopped).

  pool.py    ProcessPool: call("module:function", *args, timeout_s=...) from asyncio or a thread
  child.py   a helper's loop (serve) and what it shares with the zygote
  zygote.py  runs the setup once and forks the helpers (python -m shared.process_pool.zygote)
  frames.py  length-prefixed pickles over the helper's pipes
"""
