"""DUET_DRAIN_GRACE, declared once for the services that drain on SIGTERM (worker, gateway).

10 s by default: `duet up` stops its children one group at a time and kills what is still
running after 15 s, so a drain must end inside that. Kubernetes pods set it explicitly (k8s/:
gateway 60, prefill 60, decode 300, each covered by its terminationGracePeriodSeconds)."""
from __future__ import annotations

from typing import Any

from shared.settings.spec import setting

DRAIN_GRACE_S = 10.0


def drain_grace() -> Any:
    """The field: `drain_grace_s: float = drain_grace()`."""
    return setting(DRAIN_GRACE_S, flag="--drain-grace", env="DUET_DRAIN_GRACE",
                   help="seconds a stopping process lets in-flight work finish (a worker, after leaving the "
                        "registry: its requests and KV transfers; the gateway: its open streams)")
