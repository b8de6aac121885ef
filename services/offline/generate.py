"""`duet generate`: complete one raw prompt (no chat template) and print only the completion.

stdout gets exactly the generated text and one newline, so the command composes
in shell pipelines; everything else (logs, progress, conversion) goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from .options import UsageError, add_model_options, add_sampling_options, fail, open_model, setup_logging

PROG = "duet generate"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Complete a raw prompt (no chat template); print only the completion.")
    parser.add_argument("--prompt", required=True, help="prompt text fed as is; '-' reads it from stdin")
    add_model_options(parser)
    add_sampling_options(parser, max_tokens=64, temperature=0.0)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        return fail(PROG, "the prompt is empty")

    out = sys.stdout
    # Anything a library prints while loading or generating must not reach stdout.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            model = open_model(args)
        except UsageError as exc:
            return fail(PROG, str(exc))
        result = model.llm.generate([prompt], model.params)[0]
    out.write(result.text + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
