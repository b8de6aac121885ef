"""Every probe of the suite, in the order it runs (cheap ones first, the stack-wide ones last)."""
from __future__ import annotations

from loadtest.hostile.probe import Probe


def all_probes() -> list[Probe]:
    from loadtest.hostile.probes import admission, bodies, disconnect, fields, fit, grammar, http_parser, jinja, \
        special_tokens

    return [*fields.PROBES, *http_parser.PROBES, *special_tokens.PROBES, *jinja.PROBES, *grammar.PROBES,
            *bodies.PROBES, *fit.PROBES, *admission.PROBES, *disconnect.PROBES]
