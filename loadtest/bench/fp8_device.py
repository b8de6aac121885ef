"""FP8 on one GPU, bounded: `python -m loadtest.bench.fp8_device [--budget-s 360]`, the same as
`duet bench --suite fp8`. The sections and what each measures: loadtest/bench/fp8_sections.py.
A short table comes last (and --json)."""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    from .suite import main as suite_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--budget-s" not in argv:
        argv += ["--budget-s", "360"]
    return suite_main(["--suite", "fp8"] + argv)


if __name__ == "__main__":
    sys.exit(main())
