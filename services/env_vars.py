"""Every DUET_* environment variable Duet reads, in one table, and `duet env` that prints it.

The table is built from the declarations themselves: each command's settings dataclass
(a field names its flag and variable, shared/settings) and the few variables read outside
them (shared/settings/process_vars.py). A variable several commands read (DUET_HOST,
DUET_MODEL, ...) is one entry that names them all, with each one's default.

`duet env --plan [engine flags]` prints instead the engine plan (shared/engine/plan.py) a
worker with those flags would run on this machine: kernels, graphs, overlap, PDL, all-reduce,
tiers, each with its reason, resolved from the model's config.json without loading weights."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from services.gateway.config import GatewayConfig
from services.launcher.config import UpConfig
from services.planner.config import PlannerConfig
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from shared.settings import catalog
from shared.settings.process_vars import VARIABLES

COMMANDS = (("worker", WorkerConfig), ("gateway", GatewayConfig), ("router", RouterConfig),
            ("planner", PlannerConfig), ("up", UpConfig))
# read through another command's declaration: `duet up` places workers on GPUs by the
# workers' own DUET_TP and DUET_DEVICE (services/launcher/gpus.py)
ALSO_READ = {"DUET_TP": ("up",), "DUET_DEVICE": ("up",)}


def table() -> dict[str, catalog.EnvVar]:
    return catalog.collect(COMMANDS, VARIABLES, ALSO_READ)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet env", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--json", action="store_true", help="print the table (or the plan) as JSON")
    p.add_argument("--no-internal", dest="internal", action="store_false",
                   help="leave out the internal variables (Duet's own processes, knobs kept for experiments)")
    p.add_argument("--plan", action="store_true",
                   help="print the engine plan a worker would run on this machine instead; takes `duet worker`'s "
                        "engine flags after it (--model DIR, --tp N, ...) and loads no weights")
    args, rest = p.parse_known_args(argv)
    if args.plan:
        return _print_plan(rest, args.json)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    entries = table()
    if args.json:
        rows = [row for row in catalog.as_json(entries) if args.internal or not row["internal"]]
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        sys.stdout.write(catalog.render(entries, os.environ, internal=args.internal))
    return 0


def _print_plan(argv: list[str], as_json: bool) -> int:
    from shared.engine.config import EngineConfig
    from shared.settings.flags import parse_argv
    config = parse_argv(EngineConfig, argv, env=None, prog="duet env --plan")
    from shared.engine.plan_resolve import plan_for  # torch: only for --plan
    try:
        plan = plan_for(config)
    except ValueError as exc:  # a combination the engine refuses, a model folder it cannot read
        print(f"duet env --plan: {exc}", file=sys.stderr)
        return 1
    if as_json:
        json.dump(plan.as_dict(), sys.stdout, indent=1)
        print()
    else:
        print(plan.explain())
        print(f"\none line (the engine logs it at start): {plan.render()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
