"""What `duet generate` and `duet chat` share: their model, device and sampling options,
logging, and loading the model.

Kept free of torch imports so `--help` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.settings.process_vars import CLI_LOG_LEVEL
from shared.telemetry.logs import setup_logging as setup_stderr_log

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None,
                       help="local Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="weights and KV dtype (auto: float32 on CPU, bfloat16 on GPU)")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    group.add_argument("--log-level", choices=LOG_LEVELS, default=CLI_LOG_LEVEL.get().lower(),
                       help="stderr log level (default: $DUET_LOG_LEVEL or warning)")


def add_sampling_options(parser: argparse.ArgumentParser, *, max_tokens: int, temperature: float) -> None:
    group = parser.add_argument_group("sampling (names as in the OpenAI API and vLLM)")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate at most (default {max_tokens})")
    group.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature})")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None, help="makes sampling repeatable")
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def setup_logging(level: str) -> None:
    """All logs go to stderr: stdout carries only model output."""
    setup_stderr_log(level)
    if level != "debug":
        # transformers/tqdm chatter is noise for a one-shot command.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def sampling_params_from_args(args: argparse.Namespace):
    """Build SamplingParams; a bad value raises ValueError with the engine's message."""
    from shared.engine import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.seed, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
    )


class UsageError(Exception):
    """A mistake in the command's arguments (a bad sampling value, no such model folder)."""


@dataclass
class OfflineModel:
    llm: object  # shared.engine.LLM
    params: object  # shared.engine.SamplingParams
    model_dir: Path


def open_model(args: argparse.Namespace) -> OfflineModel:
    """Check the sampling options, find the model folder (the default model is converted on
    first use), then load it. The user's mistakes raise UsageError before anything loads;
    a failure while loading is not theirs and propagates as it is."""
    from shared.engine import LLM
    from shared.engine.model_config import ModelConfig
    from shared.model_files.default_model import ModelNotFoundError, resolve_model_dir

    try:
        params = sampling_params_from_args(args)
        model_dir = resolve_model_dir(args.model)
        ModelConfig.from_dir(model_dir)  # an architecture or quantization we do not serve is named now
    except (ValueError, ModelNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    return OfflineModel(LLM(str(model_dir), dtype=args.dtype, device=args.device), params, model_dir)


def fail(prog: str, message: str) -> int:
    """A user error: one clear line on stderr, exit status 2 (as argparse uses)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
