"""Rendered manifests: `kubectl kustomize` output as plain dicts, and label selectors."""
from __future__ import annotations

import base64
import shutil
import subprocess
from dataclasses import dataclass

import yaml


def render(path: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        raise RuntimeError("kubectl (with kustomize) is needed to render the manifests and is not on PATH")
    out = subprocess.run(["kubectl", "kustomize", path], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {path} failed:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def selects(selector: dict | None, labels: dict) -> bool:
    """Kubernetes label-selector semantics: matchLabels and matchExpressions, all must hold;
    an empty selector selects everything."""
    if selector is None:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def plain_selector(selector: dict) -> dict:
    """A Service's spec.selector (a bare label map) as a label selector."""
    return {"matchLabels": dict(selector or {})}


@dataclass
class Objects:
    """The rendered objects by kind and name."""
    docs: list[dict]

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d.get("kind") == kind]

    def get(self, kind: str, name: str) -> dict:
        for d in self.of_kind(kind):
            if d["metadata"]["name"] == name:
                return d
        raise KeyError(f"no {kind} named {name} in the rendered manifests")

    def config_value(self, kind: str, name: str, key: str) -> str:
        obj = self.get(kind, name)
        if kind == "Secret":
            if key in (obj.get("stringData") or {}):
                return str(obj["stringData"][key])
            return base64.b64decode(obj["data"][key]).decode()
        return str(obj["data"][key])

    def config_items(self, kind: str, name: str) -> dict[str, str]:
        obj = self.get(kind, name)
        out = {k: str(v) for k, v in (obj.get("data") or {}).items()}
        if kind == "Secret":
            out = {k: base64.b64decode(v).decode() for k, v in out.items()}
            out.update({k: str(v) for k, v in (obj.get("stringData") or {}).items()})
        return out
