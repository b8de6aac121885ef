"""Every DUET_* environment variable Duet reads, in one table, and `duet env` that prints it.

The table is built from the declarations themselves: each command's settings dataclass
(a field names its flag and variable, shared/settings) and the few variables read outside
them (shared/settings/process_vars.py). A variable several commands read (DUET_HOST,
DUET_MODEL, ...) is one entry that names them all, with each one's default."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from services.gateway.config import GatewayConfig
from services.launcher.config import UpConfig
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from shared.settings import catalog
from shared.settings.process_vars import VARIABLES

COMMANDS = (("worker", WorkerConfig), ("gateway", GatewayConfig), ("router", RouterConfig), ("up", UpConfig))
# read through another command's declaration: `duet up` places workers on GPUs by the
# workers' own DUET_TP and DUET_DEVICE (services/launcher/gpus.py)
ALSO_READ = {"DUET_TP": ("up",), "DUET_DEVICE": ("up",)}


def table() -> dict[str, catalog.EnvVar]:
    return catalog.collect(COMMANDS, VARIABLES, ALSO_READ)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="duet env", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("--no-internal", dest="internal", action="store_false",
                   help="leave out the variables Duet sets for its own processes")
    args = p.parse_args(argv)
    entries = table()
    if args.json:
        rows = [row for row in catalog.as_json(entries) if args.internal or not row["internal"]]
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        sys.stdout.write(catalog.render(entries, os.environ, internal=args.internal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
