"""The roles a worker takes (--role), each installing itself into the host (host.py)."""
from __future__ import annotations

from collections.abc import Callable

from services.decode import role as decode_role
from services.prefill import role as prefill_role


def install_both(host) -> None:
    """A colocated worker serves whole requests: Prefill and Decode with no KV transfer
    between them, and KV events (the router weighs its prefix cache like a prefill worker's)."""
    host.publish_kv_events()
    prefill_role.add_service(host)
    decode_role.add_service(host)


INSTALLERS: dict[str, Callable] = {"prefill": prefill_role.install, "decode": decode_role.install,
                                   "both": install_both}


def install_role(host) -> None:
    INSTALLERS[host.config.role](host)
