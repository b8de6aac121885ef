"""The roles a worker takes (--role), each installing itself into the host (host.py); a
switchable worker (--switchable) installs every role's parts and advertises one of them."""
from __future__ import annotations

from collections.abc import Callable

from services.decode import role as decode_role
from services.prefill import role as prefill_role
from services.worker_runtime.transfer import open_host_agents


def install_both(host) -> None:
    """A colocated worker serves whole requests: Prefill and Decode with no KV transfer
    between them, and KV events (the router weighs its prefix cache like a prefill worker's)."""
    host.publish_kv_events()
    prefill_role.add_service(host)
    decode_role.add_service(host)


def install_switchable(host) -> None:
    """Every role's parts at once, so a role switch (role_switch.py) changes only what the worker
    advertises: its engine, KV cache, transfer agents, reservations and outgoing writes stay, and
    work of any role that reaches it is served. `--role` is the role it advertises first."""
    host.publish_kv_events()
    open_host_agents(host)
    prefill_role.add_outgoing(host)
    decode_role.add_book(host)
    prefill_role.add_service(host)
    decode_role.add_service(host)


INSTALLERS: dict[str, Callable] = {"prefill": prefill_role.install, "decode": decode_role.install,
                                   "both": install_both}


def install_role(host) -> None:
    if host.config.switchable:
        install_switchable(host)
    else:
        INSTALLERS[host.config.role](host)
