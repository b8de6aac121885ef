"""docs/ARCHITECTURE.md keeps up with the code on the names a reader looks up there: every
Prometheus metric the services declare (as it appears on /metrics, counters with `_total`),
every span name given as a literal, and every Redis key the registry makes."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs/ARCHITECTURE.md"
SOURCES = ("services", "shared")
METRIC_KINDS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
SPAN_CALLS = {"span", "start_span", "start_as_current_span"}


def _calls():
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                        and isinstance(node.args[0].value, str):
                    func = node.func
                    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                    yield path.relative_to(REPO), name, node.args[0].value


def declared_metrics() -> dict[str, str]:
    """Exposed metric name -> where it is declared."""
    found = {}
    for path, kind, name in _calls():
        if kind in METRIC_KINDS and name.startswith("duet_"):
            exposed = name + "_total" if kind == "Counter" and not name.endswith("_total") else name
            found[exposed] = str(path)
    return found


def span_names() -> dict[str, str]:
    return {name: str(path) for path, call, name in _calls() if call in SPAN_CALLS}


def registry_keys() -> list[str]:
    """Every key and channel RegistryKeys makes, for worker `<id>` under prefix `<prefix>`."""
    import inspect

    from shared.registry.keys import RegistryKeys

    keys, found = RegistryKeys("<prefix>"), []
    for name, member in inspect.getmembers(RegistryKeys):
        if name.startswith("_") or "pattern" in name:
            continue
        if isinstance(member, property):
            found.append(getattr(keys, name))
        elif inspect.isfunction(member) and list(inspect.signature(member).parameters) == ["self", "worker_id"]:
            found.append(getattr(keys, name)("<id>"))
    return found


def test_every_metric_the_services_declare_is_in_the_architecture():
    metrics = declared_metrics()
    assert "duet_requests_total" in metrics and "duet_kv_cache_usage_ratio" in metrics
    text = DOC.read_text()
    missing = {m: where for m, where in metrics.items() if not re.search(rf"`{m}`", text)}
    assert not missing, f"add these metrics to {DOC.relative_to(REPO)}, \"Telemetry names\": {missing}"


def test_every_span_name_is_in_the_architecture():
    spans = span_names()
    assert {"route", "prefill", "decode", "reserve"} <= set(spans)
    text = DOC.read_text()
    missing = {s: where for s, where in spans.items() if f"`{s}`" not in text}
    assert not missing, f"add these spans to {DOC.relative_to(REPO)}, \"Telemetry names\": {missing}"


def test_every_registry_key_is_in_the_architecture():
    assert {"<prefix>:worker:<id>", "<prefix>:workers:events"} <= set(registry_keys())
    text = DOC.read_text()
    missing = [k for k in registry_keys() if f"`{k}`" not in text]
    assert not missing, f"add these keys to {DOC.relative_to(REPO)}, \"Registry keys and KV events\": {missing}"


def test_every_registry_hash_field_is_in_the_architecture():
    """The fields of a worker's registry entry (static, load and performance), by name."""
    from shared.perf_model.step_model import StepModel
    from shared.perf_model.transfer_model import TransferModel
    from shared.perf_model.worker_perf import WorkerPerf
    from shared.registry.worker_info import WorkerInfo

    info = WorkerInfo(worker_id="w", role="decode", address="a:1", model="m",
                      perf=WorkerPerf(StepModel((0.0,) * 5), TransferModel()))
    text = DOC.read_text()
    section = text[text.index("## 7. Registry keys"):text.index("## 8. Telemetry names")]
    fields = set(info.to_hash())
    assert {"load_free_pages", "perf_step", "heartbeat_seq"} <= fields
    missing = sorted(f for f in fields if not re.search(rf"[` ]{f}[` ]", section))
    assert not missing, f"add these registry fields to {DOC.relative_to(REPO)}, section 7: {missing}"
    import json
    for field, payload in (("perf_step", StepModel((0.0,) * 5).to_dict()), ("perf_transfer", TransferModel().to_dict())):
        keys = sorted(json.loads(json.dumps(payload)))
        absent = [k for k in keys if f'"{k}"' not in section]
        assert not absent, f"{field}'s keys {absent} are not in section 7"
