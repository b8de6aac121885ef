"""What a worker publishes about its speed in its registry entry (shared/registry/worker_info.py):
its step-time model, the model of its steps that carried prompts alone (what a split's prefill
worker runs), its handoff model (prefill workers), its inter-token target and the first-token
target its budget weighs its queue against.
Rewritten with every heartbeat as the worker refits."""
from __future__ import annotations

import json
from dataclasses import dataclass

from shared.perf_model.step_model import StepModel
from shared.perf_model.transfer_model import TransferModel


@dataclass
class WorkerPerf:
    step: StepModel | None = None          # None: not calibrated and too few live steps yet
    transfer: TransferModel | None = None  # prefill workers: their measured handoff tails
    itl_target_s: float = 0.0              # the worker's inter-token target (0: none)
    budget_floor_tokens: int = 0           # prefill tokens a step beside decode rows takes at least;
                                           # 0: the worker runs no inter-token budget (--no-itl-budget)
    ttft_target_s: float = 0.0             # the first-token target its budget weighs its queue against
                                           # (0: not weighed, --no-itl-budget-ttft)
    budget_graph_rows: int = -1            # decode rows beside which its budget still slices prefill
                                           # (a mixed step replays a graph); -1: any (no graphs)
    budget_graph_tokens: int = 0           # tokens a mixed step holds and still replays a graph (its budget's
                                           # slices stay within them); 0: any (no graphs)
    budget_row_tokens: int = 1             # tokens a decode row takes of those where it speculates: K + 1 ...
    budget_spec_rows: int = 0              # ... beside at most this many decode rows (its speculation's
                                           # max batch; above it rows decode plainly, one token); 0: none
    prefill_step: StepModel | None = None  # fitted to its steps that carried prompts alone (and the
                                           # calibration): a prefill worker's steps, which a `both`
                                           # worker's model, fitted mostly to mixed steps, misjudges

    def fields(self) -> dict[str, str]:
        return {
            "perf_step": json.dumps(self.step.to_dict()) if self.step is not None else "",
            "perf_transfer": json.dumps(self.transfer.to_dict()) if self.transfer is not None else "",
            "perf_itl_target_s": repr(self.itl_target_s),
            "perf_budget_floor_tokens": str(self.budget_floor_tokens),
            "perf_ttft_target_s": repr(self.ttft_target_s),
            "perf_budget_graph_rows": str(self.budget_graph_rows),
            "perf_budget_graph_tokens": str(self.budget_graph_tokens),
            "perf_budget_row_tokens": str(self.budget_row_tokens),
            "perf_budget_spec_rows": str(self.budget_spec_rows),
            "perf_prefill_step": json.dumps(self.prefill_step.to_dict()) if self.prefill_step is not None else "",
        }

    @classmethod
    def from_fields(cls, h: dict[str, str]) -> "WorkerPerf":
        step, transfer, prefill = h.get("perf_step", ""), h.get("perf_transfer", ""), h.get("perf_prefill_step", "")
        return cls(StepModel.from_dict(json.loads(step)) if step else None,
                   TransferModel.from_dict(json.loads(transfer)) if transfer else None,
                   float(h.get("perf_itl_target_s", 0.0) or 0.0),
                   int(h.get("perf_budget_floor_tokens", 0) or 0),
                   float(h.get("perf_ttft_target_s", 0.0) or 0.0),
                   int(h.get("perf_budget_graph_rows", -1) or -1),
                   int(h.get("perf_budget_graph_tokens", 0) or 0),
                   int(h.get("perf_budget_row_tokens", 1) or 1),
                   int(h.get("perf_budget_spec_rows", 0) or 0),
                   prefill_step=StepModel.from_dict(json.loads(prefill)) if prefill else None)
