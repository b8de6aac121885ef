"""A container's environment and command line, resolved the way the kubelet does.

envFrom first (ConfigMaps, Secrets, in order), then env in order: a literal value has its
$(VAR) references expanded against what is defined so far; valueFrom values (fieldRef
from the downward API, ConfigMap/Secret keys, resourceFieldRef) are taken as they are.
Command and args are then expanded against the whole container environment.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from tests.helpers.k8s_sim.objects import Objects

_QUANTITY = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_quantity(text) -> float:
    text = str(text)
    for suffix in sorted(_QUANTITY, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _QUANTITY[suffix]
    return float(text)


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, undefined ones stay as
    written, $$ is a literal $."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                close = text.find(")", i + 2)
                if close != -1:
                    name = text[i + 2:close]
                    out.append(env[name] if name in env else text[i:close + 1])
                    i = close + 1
                    continue
        out.append(c)
        i += 1
    return "".join(out)


@dataclass
class PodFacts:
    """What the downward API can tell a container about its pod."""
    name: str
    namespace: str
    ip: str
    node_name: str
    node_ip: str
    labels: dict
    annotations: dict
    service_account: str
    uid: str


def field_ref(path: str, pod: PodFacts) -> str:
    simple = {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "metadata.uid": pod.uid,
              "status.podIP": pod.ip, "status.podIPs": pod.ip, "spec.nodeName": pod.node_name,
              "status.hostIP": pod.node_ip, "spec.serviceAccountName": pod.service_account}
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (pod.labels if m.group(1) == "labels" else pod.annotations).get(m.group(2), "")
    raise NotImplementedError(f"fieldRef {path} is not modelled")


def resource_field_ref(ref: dict, container: dict) -> str:
    kind, res = ref["resource"].split(".", 1)
    resources = container.get("resources") or {}
    value = (resources.get(kind) or {}).get(res)
    if value is None and kind == "requests":
        value = (resources.get("limits") or {}).get(res)
    if value is None:  # no limit: the node's allocatable
        value = os.cpu_count() if res == "cpu" else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    divisor = parse_quantity(ref.get("divisor", "1"))
    return str(math.ceil(parse_quantity(value) / divisor - 1e-9))


def container_env(container: dict, pod: PodFacts, objects: Objects) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        if "configMapRef" in src:
            items = objects.config_items("ConfigMap", src["configMapRef"]["name"])
        else:
            items = objects.config_items("Secret", src["secretRef"]["name"])
        env.update({prefix + k: v for k, v in items.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(str(var.get("value", "")), env)
            continue
        vf = var["valueFrom"]
        if "fieldRef" in vf:
            env[name] = field_ref(vf["fieldRef"]["fieldPath"], pod)
        elif "configMapKeyRef" in vf:
            ref = vf["configMapKeyRef"]
            env[name] = objects.config_value("ConfigMap", ref["name"], ref["key"])
        elif "secretKeyRef" in vf:
            ref = vf["secretKeyRef"]
            env[name] = objects.config_value("Secret", ref["name"], ref["key"])
        elif "resourceFieldRef" in vf:
            env[name] = resource_field_ref(vf["resourceFieldRef"], container)
        else:
            raise NotImplementedError(f"valueFrom {sorted(vf)} for {name}")
    return env


def command_line(container: dict, env: Mapping[str, str], image_entrypoint: list[str],
                 image_cmd: list[str]) -> list[str]:
    """command replaces the image's ENTRYPOINT (and drops its CMD); args replaces CMD."""
    command = container.get("command")
    args = container.get("args")
    if command is not None:
        argv = list(command) + list(args or [])
    else:
        argv = list(image_entrypoint) + list(args if args is not None else image_cmd)
    return [expand(str(a), env) for a in argv]
