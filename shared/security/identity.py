"""Who a Duet service is, as its gRPC certificate says (mutual TLS: docs/ARCHITECTURE.md §1).

Every certificate names one role and, when the certificate is the worker's own, its id:

  URI SAN   spiffe://duet/<role>[/<id>]     what a server reads of its caller (caller_guard.py)
  DNS SANs  router.duet.internal            what a client checks when it dials (grpc_tls.py, as
            <id>.<service>.duet.internal    gRPC's target-name override): the gRPC service the
                                            server serves and, for a worker, its registry id

A worker serves the service of its role (prefill, decode); a `both` worker serves both, and so
does a `worker`: a switchable worker (`duet worker --switchable`), which may advertise any worker
role in the registry and change it at run time (services/worker/role_switch.py). The `planner`
serves nothing; it alone may ask a worker to switch (caller_guard.py). A
role-wide certificate (Kubernetes: one Secret per Deployment, since pod names are not known
before the pods exist) carries spiffe://duet/<role> and the wildcard *.<service>.duet.internal:
it proves the role, not which pod. `duet up` issues each child a certificate of its own.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ROLES = ("gateway", "router", "planner", "prefill", "decode", "both", "worker")
SPIFFE_PREFIX = "spiffe://duet/"
DNS_SUFFIX = "duet.internal"
ANY_WORKER = "*"  # the worker id of a role-wide certificate's DNS names


def served_services(role: str) -> tuple[str, ...]:
    """The gRPC services a role serves (a gateway serves none: it only calls)."""
    return {"router": ("router",), "prefill": ("prefill",), "decode": ("decode",),
            "both": ("decode", "prefill"), "worker": ("decode", "prefill")}.get(role, ())


def server_name(service: str, worker_id: str = "") -> str:
    """The name a client expects in the certificate of the server it dials: the router,
    or the worker `worker_id` serving `service` (prefill or decode)."""
    return f"{worker_id}.{service}.{DNS_SUFFIX}" if worker_id else f"{service}.{DNS_SUFFIX}"


@dataclass(frozen=True)
class Identity:
    role: str
    worker_id: str = ""  # "" for the gateway, the router, and a role-wide worker certificate

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r} (one of {', '.join(ROLES)})")
        if "/" in self.worker_id:
            raise ValueError(f"a worker id cannot hold '/': {self.worker_id!r}")

    @property
    def uri(self) -> str:
        return SPIFFE_PREFIX + self.role + (f"/{self.worker_id}" if self.worker_id else "")

    @property
    def dns_names(self) -> list[str]:
        if self.role in ("gateway", "router", "planner"):
            return [server_name(self.role)]
        return [server_name(s, self.worker_id or ANY_WORKER) for s in served_services(self.role)]

    def __str__(self) -> str:
        return self.role + (f" {self.worker_id}" if self.worker_id else "")

    @classmethod
    def from_uri(cls, uri: str) -> "Identity | None":
        if not uri.startswith(SPIFFE_PREFIX):
            return None
        role, _, worker_id = uri[len(SPIFFE_PREFIX):].partition("/")
        try:
            return cls(role, worker_id)
        except ValueError:
            return None


def identity_in(sans: Iterable[bytes | str]) -> Identity | None:
    """The Duet identity among a certificate's subject alternative names; None when it has
    none, or more than one (a certificate must name one role)."""
    found = {i for i in (Identity.from_uri(s.decode() if isinstance(s, bytes) else s) for s in sans) if i}
    return found.pop() if len(found) == 1 else None


def certificate_identity(pem: bytes) -> Identity | None:
    """The identity a PEM certificate names (its first certificate, the holder's own)."""
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    return identity_in(san.get_values_for_type(x509.UniformResourceIdentifier))
