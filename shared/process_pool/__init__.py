"""Helper processes whose calls have a hard time budget: work a request can make expensive
(chat templates, grammar compiles) runs there, never on a serving event loop, and a call past
its budget kills the process (a thread cannot be stopped).

  pool.py    ProcessPool: call("module:function", *args, timeout_s=...) from asyncio or a thread
  child.py   the helper's main loop (python -m shared.process_pool.child)
  frames.py  length-prefixed pickles over the helper's pipes
"""
