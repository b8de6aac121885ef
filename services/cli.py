"""The `duet` command: one entry point, subcommands dispatched lazily to their modules.

Each subcommand lives in the module that owns it and exposes `main(argv) -> int`;
this file only names them, so `duet --help` answers without importing torch,
and a missing module gives a clear message instead of a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
from dataclasses import dataclass

from shared.process_exit import FastExit
from shared.settings.process_vars import CLI_LOG_LEVEL, LOG_LEVELS


@dataclass(frozen=True)
class Command:
    name: str
    target: str  # "package.module:function"
    help: str
    prepend: tuple[str, ...] = ()  # arguments injected before the user's
    # a long-running service: once it returns its exit status the process ends without the
    # interpreter's teardown (shared/process_exit.py)
    service: bool = False

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def function(self) -> str:
        return self.target.split(":")[1]


COMMANDS: tuple[Command, ...] = (
    Command("up", "services.launcher.main:main",
            "start the whole stack locally (gateway, router, prefill, decode, redis)", service=True),
    Command("generate", "services.offline.generate:main", "complete one raw prompt offline and print the completion"),
    Command("chat", "services.offline.chat:main", "interactive multi-turn chat with a model, offline"),
    Command("gateway", "services.gateway.main:main", "run the OpenAI-compatible HTTP gateway", service=True),
    Command("router", "services.router.main:main", "run the router (gRPC) that picks prefill/decode pairs",
            service=True),
    Command("planner", "services.planner.main:main",
            "run the planner that sets the prefill/decode split (role switches, k8s pool sizes) to the SLOs",
            service=True),
    Command("prefill", "services.worker.main:main", "run a prefill worker (= worker --role prefill)",
            ("--role", "prefill"), service=True),
    Command("decode", "services.worker.main:main", "run a decode worker (= worker --role decode)",
            ("--role", "decode"), service=True),
    Command("worker", "services.worker.main:main", "run a worker with an explicit --role", service=True),
    Command("loadtest", "loadtest.__main__:main", "drive load against a gateway and report TTFT, ITL, goodput"),
    Command("bench", "loadtest.bench:main", "run the benchmark suite and write its report"),
    Command("convert-default-model", "shared.model_files.default_model:main",
            "convert the embedded SmolLM2-135M-Instruct into the cache and print its folder"),
    Command("env", "services.env_vars:main", "list every DUET_* environment variable: type, default, who reads it "
                                             "(--plan: the engine plan for this machine)"),
    Command("k8s-secrets", "services.launcher.k8s_secrets:main",
            "print the Secrets the k8s manifests mount (Redis password, a certificate per role) for kubectl apply"),
)
COMMANDS_BY_NAME = {c.name: c for c in COMMANDS}
EXIT_USAGE = 2


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("duet")
    except Exception:  # not installed: running from a source tree
        return "source tree"


def build_parser() -> argparse.ArgumentParser:
    width = max(len(c.name) for c in COMMANDS)
    listing = "\n".join(f"  {c.name:<{width}}  {c.help}" for c in COMMANDS)
    parser = argparse.ArgumentParser(
        prog="duet",
        description="Duet: LLM serving with disaggregated prefill and decode.",
        epilog=f"commands:\n{listing}\n\nRun `duet COMMAND --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="duet [--log-level LEVEL] COMMAND [ARGS ...]",
    )
    parser.add_argument("--version", action="version", version=f"duet {_version()}")
    parser.add_argument("--log-level", default=None, choices=LOG_LEVELS,
                        help="stderr log level for every command (also $DUET_LOG_LEVEL)")
    parser.add_argument("command", nargs="?", metavar="COMMAND", help="one of the commands below")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _error(message: str) -> int:
    print(f"duet: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _load(command: Command):
    """Import the command's function; None (after printing why) if it is not there."""
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as exc:
        own = exc.name and (command.module == exc.name or command.module.startswith(exc.name + "."))
        if own:
            _error(f"command '{command.name}' is not available: module {command.module} is missing from this installation")
        else:
            _error(f"command '{command.name}' needs the Python package '{exc.name}', which is not installed")
        return None
    function = getattr(module, command.function, None)
    if not callable(function):
        _error(f"command '{command.name}' is not available: {command.module} has no {command.function}()")
        return None
    return function


def main(argv: list[str] | None = None, fast_exit: FastExit | None = None) -> int:
    """Run one command; its exit status. `fast_exit` (run()'s): set for a service's status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level:
        os.environ["DUET_LOG_LEVEL"] = args.log_level  # commands read it for their own default
    logging.basicConfig(stream=sys.stderr, level=(args.log_level or CLI_LOG_LEVEL.get()).upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    command = COMMANDS_BY_NAME.get(args.command)
    if command is None:
        close = difflib.get_close_matches(args.command, COMMANDS_BY_NAME, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return _error(f"unknown command '{args.command}'{hint}; run `duet --help` for the list")
    function = _load(command)
    if function is None:
        return EXIT_USAGE
    try:
        code = function(list(command.prepend) + list(args.args))
    except KeyboardInterrupt:
        return 130
    if command.service and fast_exit is not None:
        fast_exit.code = int(code or 0)
    return int(code or 0)


def run() -> None:
    """The process entry point (the `duet` script, `python -m services.cli`): main(), and a
    service that returned its status exits without the interpreter's teardown."""
    fast_exit = FastExit.install()
    sys.exit(main(fast_exit=fast_exit))


if __name__ == "__main__":
    run()
