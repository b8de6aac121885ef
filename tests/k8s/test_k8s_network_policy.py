"""The NetworkPolicies in k8s/ admit exactly Duet's flows.

A small evaluator applies Kubernetes NetworkPolicy semantics (a pod selected by no policy
of a direction is open in that direction; otherwise a flow needs one matching rule; a
connection needs both the source's egress and the destination's ingress) to the rendered
pods, and the test asks it about the flows Duet uses and a set it must not allow.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.k8s.test_k8s_manifests import NAMESPACE, Rendered, pytestmark, rendered_variant, selects  # noqa: F401

UCX_PORT = 40123  # any port of UCX_TCP_PORT_RANGE


@dataclass(frozen=True)
class Endpoint:
    """One side of a connection: a pod (of the rendered set or outside it) and its namespace."""
    name: str
    namespace: str
    labels: dict = field(default_factory=dict, hash=False)
    namespace_labels: dict = field(default_factory=dict, hash=False)


def pod_endpoint(r: Rendered, role: str) -> Endpoint:
    pod = r.pod(role)
    return Endpoint(role, NAMESPACE, pod.labels, {"kubernetes.io/metadata.name": NAMESPACE})


CLIENT = Endpoint("client", "", {}, {})  # outside the cluster (or any namespace without labels)
PROMETHEUS = Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"},
                      {"kubernetes.io/metadata.name": "monitoring"})
KUBE_DNS = Endpoint("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, {"kubernetes.io/metadata.name": "kube-system"})


def peer_matches(peer: dict, policy_namespace: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        return other.namespace == ""  # only outside traffic is addressed by IP here
    ns_selector, pod_selector = peer.get("namespaceSelector"), peer.get("podSelector")
    if ns_selector is None:
        in_namespace = other.namespace == policy_namespace
    else:
        in_namespace = other.namespace != "" and selects(ns_selector, other.namespace_labels)
    return in_namespace and (pod_selector is None or selects(pod_selector, other.labels))


def port_matches(ports: list[dict] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        assert isinstance(p["port"], int), "named ports in policies are not modelled here"
        if p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def direction_allows(r: Rendered, direction: str, subject: Endpoint, other: Endpoint, port: int, protocol: str) -> bool:
    if subject.namespace != NAMESPACE:
        return True  # outside pods are not governed by these policies
    policies = [p for p in r.of_kind("NetworkPolicy")  # an empty podSelector selects every pod
                if direction in p["spec"].get("policyTypes", ["Ingress"])
                and selects(p["spec"]["podSelector"], subject.labels)]
    if not policies:
        return True
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in policies:
        for rule in policy["spec"].get(key, []):
            peers = rule.get(peers_key)
            if (not peers or any(peer_matches(peer, NAMESPACE, other) for peer in peers)) \
                    and port_matches(rule.get("ports"), port, protocol):
                return True
    return False


def allowed(r: Rendered, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
    return (direction_allows(r, "Egress", src, dst, port, protocol)
            and direction_allows(r, "Ingress", dst, src, port, protocol))


@pytest.fixture(params=["gpu", "gpu-planner", "cpu"])
def rendered(request) -> Rendered:
    return rendered_variant(request.param)


def test_every_policy_and_peer_selects_existing_pods(rendered):
    r = rendered
    for policy in r.of_kind("NetworkPolicy"):
        selector = policy["spec"]["podSelector"]
        assert selector == {} or any(selects(selector, p.labels) for p in r.pods), \
            f"{policy['metadata']['name']} selects no pod"
        for key, peers_key in (("ingress", "from"), ("egress", "to")):
            for rule in policy["spec"].get(key, []):
                for peer in rule.get(peers_key, []):
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        assert any(selects(peer["podSelector"], p.labels) for p in r.pods), \
                            f"{policy['metadata']['name']}: peer {peer} selects no pod"


def test_duet_flows_are_admitted(rendered):
    r = rendered
    ep = {role: pod_endpoint(r, role) for role in ("gateway", "router", "prefill", "decode", "redis", "otel-collector")}
    required = [
        (CLIENT, ep["gateway"], 8000),
        (ep["gateway"], ep["router"], 50050),
        (ep["gateway"], ep["prefill"], 50060),
        (ep["gateway"], ep["decode"], 50060),
        (ep["router"], ep["prefill"], 50060),  # its health check: proving a registry entry's identity
        (ep["router"], ep["decode"], 50060),
        (ep["prefill"], ep["decode"], UCX_PORT),
        (ep["decode"], ep["prefill"], UCX_PORT),
        (PROMETHEUS, ep["gateway"], 9102),
        (PROMETHEUS, ep["router"], 9101),
        (PROMETHEUS, ep["prefill"], 9100),
        (PROMETHEUS, ep["decode"], 9100),
    ]
    for role in ("gateway", "router", "prefill", "decode"):
        required += [(ep[role], ep["redis"], 6379), (ep[role], ep["otel-collector"], 4317)]
    if r.planned:  # components/planner: it reads metrics, switches roles, reads the registry
        planner = pod_endpoint(r, "planner")
        required += [(planner, ep["gateway"], 9102), (planner, ep["redis"], 6379),
                     (planner, ep["otel-collector"], 4317), (PROMETHEUS, planner, 9103),
                     (planner, CLIENT, 443),  # the Kubernetes API server: the pools' scale
                     # a switched pod writes KV into, or is written by, one of its own pool
                     (ep["prefill"], ep["prefill"], UCX_PORT), (ep["decode"], ep["decode"], UCX_PORT)]
        required += [(planner, ep[w], port) for w in ("prefill", "decode") for port in (50060, 9100)]
        ep["planner"] = planner
    for src, dst, port in required:
        assert allowed(r, src, dst, port), f"{src.name} -> {dst.name}:{port} is blocked"
    for role in ep:
        assert allowed(r, ep[role], KUBE_DNS, 53, "UDP"), f"{role} cannot resolve names"


def test_everything_else_is_denied(rendered):
    r = rendered
    ep = {role: pod_endpoint(r, role) for role in ("gateway", "router", "prefill", "decode", "redis", "otel-collector")}
    forbidden = [
        (CLIENT, ep["router"], 50050),          # only the gateway is public
        (CLIENT, ep["gateway"], 9102),          # its /metrics port is Prometheus's only
        (CLIENT, ep["prefill"], 50060),
        (CLIENT, ep["decode"], 50060),
        (CLIENT, ep["decode"], UCX_PORT),
        (CLIENT, ep["redis"], 6379),
        (CLIENT, ep["otel-collector"], 4317),
        (ep["prefill"], ep["decode"], 50060),   # prefill talks to decode through NIXL only
        (ep["decode"], ep["gateway"], 8000),
        (ep["router"], ep["prefill"], UCX_PORT),  # the router is off the data path
        (ep["router"], ep["decode"], 9100),
        (ep["router"], ep["gateway"], 8000),
        (ep["gateway"], ep["decode"], UCX_PORT),
        (ep["prefill"], ep["decode"], 41000),   # outside UCX_TCP_PORT_RANGE
        (ep["redis"], ep["gateway"], 8000),     # Redis initiates nothing
        (ep["otel-collector"], ep["redis"], 6379),
        (PROMETHEUS, ep["redis"], 6379),
        (PROMETHEUS, ep["decode"], 50060),
        (ep["prefill"], CLIENT, 443),           # workers have no way out of the cluster
        (ep["decode"], CLIENT, 443),
        (ep["router"], CLIENT, 443),
        (ep["gateway"], CLIENT, 443),
    ]
    if r.planned:
        planner = pod_endpoint(r, "planner")
        forbidden += [
            (CLIENT, planner, 9103),
            (ep["gateway"], planner, 9103),         # nothing calls the planner
            (ep["prefill"], planner, 9103),
            (planner, ep["gateway"], 8000),         # it reads metrics only, never the API
            (planner, ep["router"], 50050),
            (planner, ep["decode"], UCX_PORT),
            (planner, CLIENT, 80),
            (ep["prefill"], ep["decode"], 41000),
        ]
    else:  # fixed roles: KV moves between the pools only
        forbidden += [(ep["prefill"], ep["prefill"], UCX_PORT), (ep["decode"], ep["decode"], UCX_PORT)]
    for src, dst, port in forbidden:
        assert not allowed(r, src, dst, port), f"{src.name} -> {dst.name}:{port} should be blocked"
