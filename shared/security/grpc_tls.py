"""TLS and mutual TLS for Duet's gRPC (gateway -> router, gateway -> prefill/decode).

One config dataclass, the same flags on every service (env DUET_GRPC_TLS_*), read from
mounted certificate files (cert-manager's Secret keys tls.crt, tls.key, ca.crt):

  server (router, workers): cert + key -> TLS; + CA -> mTLS (a client certificate signed
                            by that CA is required)
  client (gateway, router): CA -> verify servers against it (else the system roots);
                            cert + key -> present them (what an mTLS server asks for)

Nothing set -> plaintext (`duet up --insecure`, or a service started by hand without the
flags). Under mutual TLS, certificates carry identities (identity.py): a server lets each
caller's role call only the methods it needs (caller_guard.py), and a client checks the
name of the server it means (the router, or worker <id> serving decode or prefill; gRPC's
ssl_target_name_override) rather than the address it dials, which came from the registry.
Files are read once at start; a rotated certificate takes effect on restart."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from shared.security.secret_files import read_pem
from shared.settings.spec import setting


@dataclass
class GrpcTlsConfig:
    cert_file: str | None = setting(
        flag="--grpc-tls-cert-file", env="DUET_GRPC_TLS_CERT_FILE",
        help="PEM certificate: servers serve TLS with it, clients present it for mTLS")
    key_file: str | None = setting(
        flag="--grpc-tls-key-file", env="DUET_GRPC_TLS_KEY_FILE", help="PEM private key of that certificate")
    ca_file: str | None = setting(
        flag="--grpc-tls-ca-file", env="DUET_GRPC_TLS_CA_FILE",
        help="PEM CA bundle: servers then require client certificates it signed (mTLS), clients verify "
             "servers with it")
    _creds: grpc.ChannelCredentials | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("--grpc-tls-cert-file and --grpc-tls-key-file go together")

    @property
    def server_enabled(self) -> bool:
        return bool(self.cert_file)

    @property
    def client_enabled(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    @property
    def mutual(self) -> bool:
        return bool(self.cert_file and self.ca_file)

    def describe(self, side: str) -> str:
        on = self.server_enabled if side == "server" else self.client_enabled
        return ("mTLS" if self.mutual else "TLS") if on else "plaintext"

    # --- credentials ----------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.server_enabled:
            raise ValueError("a TLS gRPC server needs --grpc-tls-cert-file and --grpc-tls-key-file")
        pair = (read_pem(self.key_file, "gRPC TLS key"), read_pem(self.cert_file, "gRPC TLS certificate"))
        ca = read_pem(self.ca_file, "gRPC TLS CA") if self.ca_file else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = read_pem(self.ca_file, "gRPC TLS CA") if self.ca_file else None
        key = read_pem(self.key_file, "gRPC TLS key") if self.key_file else None
        cert = read_pem(self.cert_file, "gRPC TLS certificate") if self.cert_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """For a server: under mutual TLS, the role check on every method (caller_guard.py)."""
        if not self.mutual:
            return []
        from shared.security.caller_guard import CallerGuard
        return [CallerGuard()]

    # --- use ------------------------------------------------------------------------------

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind `address` on the server, with TLS when configured; the bound port (0 = failed)."""
        if self.server_enabled:
            return server.add_secure_port(address, self.server_credentials())
        return server.add_insecure_port(address)

    def aio_channel(self, address: str, server_name: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to `address`, with TLS when configured; the server's certificate
        must then name `server_name` (identity.server_name), whatever the address."""
        opts = list(options)
        if self.client_enabled:
            opts.append(("grpc.ssl_target_name_override", server_name))
            return grpc.aio.secure_channel(address, self._cached_channel_credentials(), options=opts)
        return grpc.aio.insecure_channel(address, options=opts)

    def _cached_channel_credentials(self) -> grpc.ChannelCredentials:
        if self._creds is None:  # the gateway opens a channel per worker: read the files once
            self._creds = self.channel_credentials()
        return self._creds

    def check_identity(self, role: str, worker_id: str = "") -> None:
        """Under mutual TLS, this process's certificate must name its role (and, if it names a
        worker, this one): a mismatch fails at start, not later as calls refused or a worker
        the router never trusts."""
        if not self.mutual:
            return
        from shared.security.identity import certificate_identity
        found = certificate_identity(read_pem(self.cert_file, "gRPC TLS certificate"))
        if found is None:
            raise ValueError(f"the gRPC certificate {self.cert_file} names no Duet role "
                             f"(a URI spiffe://duet/<role>[/<id>]: shared/security/identity.py)")
        if found.role != role or (found.worker_id and found.worker_id != worker_id):
            want = role + (f" {worker_id}" if worker_id else "")
            raise ValueError(f"the gRPC certificate {self.cert_file} is {found}'s, not {want}'s")

    def check(self, side: str) -> None:
        """Read the files now, so a bad path fails the process at start with a clear message."""
        if side == "server" and self.server_enabled:
            self.server_credentials()
        elif side == "server" and self.ca_file:
            raise ValueError("--grpc-tls-ca-file on a server needs --grpc-tls-cert-file and --grpc-tls-key-file")
        elif side == "client" and self.client_enabled:
            self._cached_channel_credentials()
