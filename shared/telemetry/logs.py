"""A service's stderr log at the level it was given.

`duet <command>` configures the root logger before the command parses its own flags (at
DUET_LOG_LEVEL, default warning, for the one-shot commands), so a service's
`logging.basicConfig(level=...)` alone would do nothing: its own --log-level (default info)
sets the root level here explicitly."""
from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> int:
    """The numeric level set (an unknown name reads as warning)."""
    numeric = getattr(logging, level.upper(), logging.WARNING)
    logging.basicConfig(stream=sys.stderr, level=numeric, format=FORMAT)
    logging.getLogger().setLevel(numeric)
    return numeric
