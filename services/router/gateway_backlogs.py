"""The prompt tokens waiting in the gateways' admission queues, summed over the gateways.

Each route carries its gateway's own backlog (`RouteRequest.admission_waiting_tokens`) and the
gateway's id; with several gateways in front of the workers (`duet up` starts one per GPU) one
route's figure is only its gateway's share of what the prefill workers get next. The router keeps
the latest figure of each gateway and sums those heard from within FRESH_S (a gateway that stopped
routing, or restarted under a new id, stops counting), for the overflow rule (placement.py). A
gateway serving several models sends each route its model's backlog (each model's admission is a
pool of its own), so the figures are kept and summed per model: another model's queue is not
what this model's prefill workers get next."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

FRESH_S = 2.0  # a gateway's figure counts this long after its last route


@dataclass
class GatewayBacklogs:
    clock: Callable[[], float] = time.monotonic
    # (gateway id, model) -> (tokens, when)
    _latest: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)

    def total(self, gateway_id: str, tokens: int, model: str = "") -> int:
        """Record this gateway's backlog of `model`; the sum of that model's over the gateways
        heard from recently."""
        now = self.clock()
        if gateway_id:
            self._latest[(gateway_id, model)] = (max(0, tokens), now)
        self._latest = {k: v for k, v in self._latest.items() if now - v[1] <= FRESH_S}
        own = 0 if gateway_id else max(0, tokens)  # a gateway without an id: its figure alone
        return own + sum(t for (_, m), (t, _) in self._latest.items() if m == model)
