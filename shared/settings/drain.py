"""DUET_DRAIN_GRACE, declared once for the services that drain on SIGTERM (worker, gateway)
and for `duet up`, which drains the whole stack within it.

10 s by default. `duet up` gives its gateway the whole grace and its workers a few seconds
less, so a worker ends its leftovers (and the gateway sends their streams an error event)
before the gateway's own deadline (services/launcher/shutdown.py). Kubernetes pods set it
explicitly (k8s/: gateway 60, prefill 60, decode 300, each covered by its
terminationGracePeriodSeconds)."""
from __future__ import annotations

from typing import Any

from shared.settings.spec import setting

DRAIN_GRACE_S = 10.0


def drain_grace() -> Any:
    """The field: `drain_grace_s: float = drain_grace()`."""
    return setting(DRAIN_GRACE_S, flag="--drain-grace", env="DUET_DRAIN_GRACE",
                   help="seconds a stopping process lets in-flight work finish (a worker, after leaving the "
                        "registry: its requests and KV transfers; the gateway: its open streams; duet up: the "
                        "whole stack)")
