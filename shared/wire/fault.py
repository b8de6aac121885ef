"""Which worker a failed RPC's failure lies with, in its trailing metadata: a prefill worker
whose KV writes into the decode worker failed answers UNAVAILABLE like a prefill worker that
is going away, and the gateway, migrating the request, must know which one to leave."""
from __future__ import annotations

FAULT_KEY = "duet-fault"  # value: "decode" or "prefill"


def fault_of(trailing_metadata) -> str | None:
    """The worker role a failed call's trailing metadata blames, or None."""
    for key, value in trailing_metadata or ():
        if key == FAULT_KEY:
            return value if isinstance(value, str) else value.decode()
    return None
