"""Copy the OpenAI response schemas the gateway tests need out of OpenAI's spec.

Usage: python tests/helpers/data/openai/extract_schemas.py PATH/TO/openapi.yaml [SOURCE_FILE]

Writes schemas.json beside this script: the named schemas plus everything they
$ref, with prose (description, examples, x-* vendor keys) dropped so the copy
stays small. The spec is MIT licensed (see LICENSE here). The tests read only
the copy in the repo; run this script again to refresh it from a newer spec.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "Response",
    "ResponseStreamEvent",
)
PROSE_KEYS = {"description", "example", "examples", "title", "deprecated"}
REF_PREFIX = "#/components/schemas/"


def strip_prose(schema):
    """Drop documentation keys, but never a property that happens to be named like one."""
    if isinstance(schema, list):
        return [strip_prose(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in PROSE_KEYS or key.startswith("x-"):
            continue
        if key in ("properties", "patternProperties", "$defs"):
            out[key] = {name: strip_prose(sub) for name, sub in value.items()}
        else:
            out[key] = strip_prose(value)
    return out


def referenced_names(schema) -> set[str]:
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(REF_PREFIX):
                found.add(ref[len(REF_PREFIX):])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def extract(spec: dict, roots=ROOTS) -> dict:
    all_schemas = spec["components"]["schemas"]
    picked: dict = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in picked:
            continue
        picked[name] = strip_prose(all_schemas[name])
        todo.extend(referenced_names(picked[name]) - picked.keys())
    return dict(sorted(picked.items()))


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__, file=sys.stderr)
        return 2
    spec_path = Path(argv[0])
    spec = yaml.load(spec_path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    source = Path(argv[1]).read_text().strip() if len(argv) > 1 else ""
    out = {
        "note": "Extracted from OpenAI's OpenAPI spec (MIT, Copyright (c) OpenAI; see LICENSE beside this file).",
        "source": source,
        "openapi": spec.get("openapi"),
        "components": {"schemas": extract(spec)},
    }
    target = Path(__file__).with_name("schemas.json")
    target.write_text(json.dumps(out, indent=1, sort_keys=False) + "\n")
    print(f"wrote {len(out['components']['schemas'])} schemas to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
