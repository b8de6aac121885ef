"""The router's predictions, as Prometheus sees them (services/router/placement.py)."""
from __future__ import annotations

from prometheus_client import Histogram

from services.router.placement import Placement

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class PlacementMetrics:
    def __init__(self, registry):
        self.ttft = Histogram("duet_router_predicted_ttft_seconds", "Predicted time to first token of the chosen "
                              "placement, by kind", ["kind"], buckets=_SECONDS, registry=registry)
        self.itl_impact = Histogram("duet_router_predicted_itl_impact_seconds", "Predicted growth of the decode "
                                    "step where the chosen placement adds work, by kind", ["kind"],
                                    buckets=(0.0,) + _SECONDS, registry=registry)

    def observe(self, placement: Placement) -> None:
        if placement.chosen is not None:
            self.ttft.labels(kind=placement.kind).observe(placement.chosen.ttft_s)
            self.itl_impact.labels(kind=placement.kind).observe(max(0.0, placement.chosen.itl_impact_s))
