"""Which workers change role to reach a target split, and in which order.

Only switchable workers move (registry field `switchable`); a worker keeps its role where the
target has room for it. Among the workers of a role with too many, the least loaded move first
(fewest running requests, then least KV in use: the least work to finish under the new role).
Moves to `both` go first, then to prefill, then to decode, so every split on the way can serve:
a `both` worker serves alone, and a prefill worker is added before the decode worker it pairs
with is taken away."""
from __future__ import annotations

from services.planner.predict import Split
from shared.registry.worker_info import WorkerInfo

ROLE_ORDER = ("both", "prefill", "decode")


def fixed_split(workers: list[WorkerInfo]) -> Split:
    return Split.of(w.role for w in workers if not w.switchable)


def assign(workers: list[WorkerInfo], target: Split) -> list[tuple[WorkerInfo, str]]:
    """(worker, new role) for each worker that must switch, in the order to switch them."""
    keep: dict[str, list[WorkerInfo]] = {role: [] for role in ROLE_ORDER}
    spare: list[WorkerInfo] = []
    # workers that cannot switch hold their places first, then the busiest keep their role
    by_load = sorted(workers, key=lambda w: (w.switchable, -w.load.running_requests, -w.load.kv_usage, w.worker_id))
    for w in by_load:
        if not w.switchable or len(keep[w.role]) < target.count(w.role):
            keep[w.role].append(w)
        else:
            spare.append(w)
    spare.sort(key=lambda w: (w.load.running_requests, w.load.kv_usage, w.worker_id))
    out = []
    for role in ROLE_ORDER:
        for _ in range(max(0, target.count(role) - len(keep[role]))):
            if not spare:
                return out
            out.append((spare.pop(0), role))
    return out
