"""`duet loadtest ...` and `python -m loadtest ...`.

    duet loadtest [run] --base-url URL [flags]    load-test a server (default command)
    duet loadtest compare A.json B.json          two result files side by side
    duet loadtest report results.json            table and plots again, optionally other SLOs
    duet loadtest overload --base-url URL        arrivals at 10x capacity: 200/429 counts, RSS
    duet loadtest multiturn --base-url URL       conversations turn by turn: TTFT and cache use by turn
    duet loadtest hostile --base-url URL         bounded hostile-client probes, PASS/FAIL each
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {"overload": "loadtest.overload:main", "multiturn": "loadtest.multiturn.main:main",
            "hostile": "loadtest.hostile.cli:main", "compare": "loadtest.file_commands:compare_main",
            "report": "loadtest.file_commands:report_main"}  # imported when asked for: some are heavy


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else "run"
    rest = argv[1:] if argv and argv[0] == command else argv
    if command == "run":
        from loadtest.cli_args import config_from, run_parser
        from loadtest.run_command import run_command

        return run_command(config_from(run_parser().parse_args(rest)))
    if command in COMMANDS:
        module, _, function = COMMANDS[command].partition(":")
        return getattr(importlib.import_module(module), function)(rest)
    print(f"duet loadtest: unknown command {command!r} (run, compare, report, overload, multiturn, hostile)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
