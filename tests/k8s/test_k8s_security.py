"""The security wiring of k8s/: API keys and gRPC mutual TLS on in the default (gpu)
overlay, from Secrets with cert-manager's key names; off in the cpu overlay; HTTPS at the
gateway and cert-manager issuers as optional components; the gateway's /metrics on its own
port. Command lines and environments are parsed with the services' own parsers."""
from __future__ import annotations

from pathlib import PurePosixPath

from tests.k8s.test_k8s_manifests import Rendered, parse_duet_command, pytestmark, rendered, rendered_variant  # noqa: F401

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


def test_gpu_overlay_requires_api_keys_and_mutual_tls_from_secrets():
    for variant in ("gpu", "gpu+components"):
        r = rendered_variant(variant)
        for pod in r.duet_pods:
            tls = grpc_tls(r, pod)
            assert tls.mutual, f"{variant}/{pod.name}: gRPC is not mutual TLS"
            files = {tls.cert_file: "tls.crt", tls.key_file: "tls.key", tls.ca_file: "ca.crt"}
            for path, key in files.items():
                assert mounted_secret(pod, pod.main, path) == ("duet-grpc-tls", key)
        gateway = r.pod("gateway")
        sec = parse_duet_command(r, gateway).config.security
        assert sec.auth_enabled and not sec.api_keys, "keys come from the mounted file only"
        assert mounted_secret(gateway, gateway.main, sec.api_keys_file) == ("duet-api-keys", "keys")
        assert r.get("Secret", "duet-api-keys") is None and r.get("Secret", "duet-grpc-tls") is None, \
            "secrets are created out of band (or by cert-manager), never rendered"
        # the gateway checks one name in every server's certificate (workers are dialled by IP)
        assert sec.grpc_tls.server_name == "duet-internal"


def test_cpu_overlay_runs_without_keys_or_tls():
    r = rendered_variant("cpu")
    for pod in r.duet_pods:
        assert grpc_tls(r, pod).describe("server") == "plaintext"
        assert not any(v.get("secret", {}).get("secretName") in ("duet-grpc-tls", "duet-api-keys", "duet-gateway-tls")
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
    assert set(certs) >= {"duet-grpc-tls", "duet-gateway-tls"}
    grpc_cert = certs["duet-grpc-tls"]["spec"]
    assert {"server auth", "client auth"} <= set(grpc_cert["usages"])
    router_host = parse_duet_command(r, gateway).config.router_address.split(":")[0]
    assert {sec.grpc_tls.server_name, router_host} <= set(grpc_cert["dnsNames"])
    assert "duet-gateway" in certs["duet-gateway-tls"]["spec"]["dnsNames"]
    issuers = {i["metadata"]["name"]: i for i in r.of_kind("Issuer")}
    for cert in certs.values():
        assert cert["spec"]["issuerRef"]["name"] in issuers
    assert issuers["duet-ca"]["spec"]["ca"]["secretName"] in certs  # the CA Issuer signs with duet-ca
    assert all(c["metadata"].get("namespace") == "duet" for c in (*certs.values(), *issuers.values()))
