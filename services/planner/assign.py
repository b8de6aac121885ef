"""Which workers change role to reach a target split, and in which order.

Only switchable workers move (registry field `switchable`); a worker keeps its role where the
target has room for it. Among the workers of a role with too many, the least loaded move first
(fewest running requests, then least KV in use: the least work to finish under the new role).
Moves to `both` go first, then to prefill, then to decode, so every split on the way can serve:
a `both` worker serves alone, and a prefill worker is added before the decode worker it pairs
with is taken away.

A switch moves new work only; the streams decoding on a worker stay there. So a decode worker
turned `both` beside a prefill worker turned `both` would carry the whole running batch while
the other carries none (measured on two H200s: TPOT 2.5x the decode step). `hand_overs` counts
the streams each switching worker hands over (SetRole `hand_over`, once every worker holds its
new role) so the batch spreads evenly over the new split's decoders: down to its share, or all
of them for a worker turning prefill (whose long prefill steps would stretch their every token).
Their gateways continue them elsewhere from the tokens sent (failover's path, token for token),
and each moved stream's KV is rebuilt where it lands from what is cheapest: a worker turning
prefill may still prefill its own streams' continuations (the router excludes it as a decoder
only), so their pages move to the new decode worker instead of being recomputed; a worker turned
`both` that prefilled a stream's prompt holds it. Only a surplus of at least `min_streams` is
handed over."""
from __future__ import annotations

import math

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


def hand_overs(workers: list[WorkerInfo], moves: list[tuple[WorkerInfo, str]], min_streams: int) -> dict[str, int]:
    """worker id -> decoding streams it hands over after its switch (only workers that switch, only
    a surplus of at least `min_streams`; 0 turns it off)."""
    if min_streams <= 0 or not moves:
        return {}
    after = {w.worker_id: w.role for w in workers} | {w.worker_id: role for w, role in moves}
    decoders = [w for w in workers if after[w.worker_id] != "prefill"]
    if not decoders:
        return {}
    rows = {w.worker_id: w.load.running_requests if w.role != "prefill" else 0 for w in workers}
    share = math.ceil(sum(rows.values()) / len(decoders))
    out = {}
    for w, role in moves:
        surplus = rows[w.worker_id] - (0 if role == "prefill" else share)
        if surplus >= min_streams:
            out[w.worker_id] = surplus
    return out
