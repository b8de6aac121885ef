"""The security wiring of k8s/: gRPC mutual TLS on in every overlay, each Deployment with the
certificate of its role from a Secret with cert-manager's key names (duet-grpc-<role>); API
keys on in the default (gpu) overlay, off in the cpu one; HTTPS at the gateway and
cert-manager issuers as optional components, the certificates naming the roles as the
services check them; the gateway's /metrics on its own port. Command lines and environments
are parsed with the services' own parsers."""
from __future__ import annotations

from pathlib import PurePosixPath

from shared.security.identity import Identity, server_name
from tests.k8s.test_k8s_manifests import (  # noqa: F401
    DUET_ROLES,
    Rendered,
    parse_duet_command,
    pytestmark,
    rendered,
    rendered_variant,
)

CERT_MANAGER_KEYS = {"tls.crt", "tls.key", "ca.crt"}


def mounted_secret(pod, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) that a file path inside the container comes from."""
    p = PurePosixPath(path)
    for mount in container.get("volumeMounts", []):
        if p.parent == PurePosixPath(mount["mountPath"]):
            volume = next(v for v in pod.spec["volumes"] if v["name"] == mount["name"])
            assert "secret" in volume, f"{pod.name}: {path} is not from a Secret"
            assert mount.get("readOnly") is True
            return volume["secret"]["secretName"], p.name
    raise AssertionError(f"{pod.name}: nothing mounted at {p.parent}")


def grpc_tls(r: Rendered, pod):
    cfg = parse_duet_command(r, pod).config
    return cfg.security.grpc_tls if pod.role == "gateway" else cfg.tls


def test_every_service_gets_metrics_and_api_port_apart(rendered):
    gateway = rendered.pod("gateway")
    cfg = parse_duet_command(rendered, gateway).config
    assert cfg.security.metrics_port == gateway.port("metrics") != gateway.port("http")
    assert gateway.template["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.security.metrics_port)


def test_every_overlay_runs_mutual_tls_with_a_certificate_per_role(rendered):
    r = rendered
    for pod in r.duet_pods:
        tls = grpc_tls(r, pod)
        assert tls.mutual, f"{r.variant}/{pod.name}: gRPC is not mutual TLS"
        assert tls.interceptors(), f"{r.variant}/{pod.name}: callers' roles are not checked"
        files = {tls.cert_file: "tls.crt", tls.key_file: "tls.key", tls.ca_file: "ca.crt"}
        for path, key in files.items():
            assert mounted_secret(pod, pod.main, path) == (r.grpc_secret(pod.role), key), (r.variant, pod.name)


def test_gpu_overlay_requires_api_keys_from_a_secret():
    for variant in ("gpu", "gpu+components"):
        r = rendered_variant(variant)
        gateway = r.pod("gateway")
        sec = parse_duet_command(r, gateway).config.security
        assert sec.auth_enabled and not sec.api_keys, "keys come from the mounted file only"
        assert mounted_secret(gateway, gateway.main, sec.api_keys_file) == ("duet-api-keys", "keys")


def test_cpu_overlay_runs_without_api_keys_or_https():
    r = rendered_variant("cpu")
    for pod in r.duet_pods:
        assert not any(v.get("secret", {}).get("secretName") in ("duet-api-keys", "duet-gateway-tls")
                       for v in pod.spec.get("volumes", []))
    sec = parse_duet_command(r, r.pod("gateway")).config.security
    assert not sec.auth_enabled and not sec.https


def test_gateway_https_and_cert_manager_components_fit_together():
    r = rendered_variant("gpu+components")
    gateway = r.pod("gateway")
    sec = parse_duet_command(r, gateway).config.security
    assert sec.https
    assert mounted_secret(gateway, gateway.main, sec.tls_cert_file) == ("duet-gateway-tls", "tls.crt")
    assert mounted_secret(gateway, gateway.main, sec.tls_key_file) == ("duet-gateway-tls", "tls.key")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = gateway.main[kind]["httpGet"]
        assert probe["scheme"] == "HTTPS" and probe["path"] in ("/health", "/live"), kind
    assert r.get("Service", "duet-gateway")["spec"]["ports"][0]["appProtocol"] == "https"
    certs = {c["spec"]["secretName"]: c for c in r.of_kind("Certificate")}
    roles = (*DUET_ROLES, "worker", "planner")  # the planner's and its switchable workers' too
    assert set(certs) >= {"duet-gateway-tls", *(f"duet-grpc-{role}" for role in roles)}
    for role in roles:  # each names its role as the services check it (shared/security/identity.py)
        spec = certs[f"duet-grpc-{role}"]["spec"]
        assert spec["uris"] == [Identity(role).uri] and spec["dnsNames"] == Identity(role).dns_names, role
        serves = role not in ("gateway", "planner")  # those two only call
        assert "client auth" in spec["usages"] and ("server auth" in spec["usages"]) == serves, role
    # the gateway dials the router by its Service and checks the router's name, not that address
    assert server_name("router") in certs["duet-grpc-router"]["spec"]["dnsNames"]
    assert "duet-gateway" in certs["duet-gateway-tls"]["spec"]["dnsNames"]
    issuers = {i["metadata"]["name"]: i for i in r.of_kind("Issuer")}
    for cert in certs.values():
        assert cert["spec"]["issuerRef"]["name"] in issuers
    assert issuers["duet-ca"]["spec"]["ca"]["secretName"] in certs  # the CA Issuer signs with duet-ca
    assert all(c["metadata"].get("namespace") == "duet" for c in (*certs.values(), *issuers.values()))
