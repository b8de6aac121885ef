"""The router's sum of what waits in the gateways' admission queues, per model
(services/router/gateway_backlogs.py): each gateway's latest figure counts, a gateway that went
quiet stops counting after FRESH_S, and a route without a gateway id counts its own figure."""
from __future__ import annotations

from services.router.gateway_backlogs import FRESH_S, GatewayBacklogs


def test_the_latest_figure_of_each_recent_gateway_is_summed():
    now = [100.0]
    backlogs = GatewayBacklogs(clock=lambda: now[0])
    assert backlogs.total("a", 30_000) == 30_000
    assert backlogs.total("b", 20_000) == 50_000
    assert backlogs.total("a", 5_000) == 25_000  # a's latest replaces its earlier figure
    assert backlogs.total("", 7_000) == 25_000 + 7_000  # no id (an older gateway): its own figure on top
    now[0] += FRESH_S + 0.1
    assert backlogs.total("b", 1_000) == 1_000  # a went quiet (stopped, or restarted under a new id)
    assert backlogs.total("c", -5) == 1_000  # never negative


def test_each_model_sums_its_own_backlog():
    """A gateway serving two models sends each route its model's waiting prompts (each model's
    admission is a pool of its own): one model's queue does not push another's prompts to overflow."""
    backlogs = GatewayBacklogs(clock=lambda: 100.0)
    assert backlogs.total("a", 30_000, "big") == 30_000
    assert backlogs.total("a", 0, "small") == 0  # the same gateway, the other model's pool: nothing waits
    assert backlogs.total("b", 2_000, "small") == 2_000
    assert backlogs.total("b", 10_000, "big") == 40_000
