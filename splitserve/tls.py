"""TLS for every gRPC and HTTP listener, and for the channels between components.

One `TLSConfig` per process, filled from `--tls-cert/--tls-key/--tls-ca/--tls-server-name`
(deploy/cli.py). Who checks what:
  public listeners (router gRPC `Generation`, router HTTP)  server certificate only; clients
      prove themselves with an API key (credentials.py), not with a certificate.
  cluster listeners (router `--cluster-port`, worker gRPC)  server certificate, and with a CA
      a client certificate signed by it (mutual TLS), plus the cluster credential.
  dialing (workers → router, router → workers, `up`, clients)  verify the server against the
      CA; present our own certificate so cluster listeners accept us.
No TLS config means plaintext: fine on loopback (the laptop default), warned about elsewhere.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TLSConfig:
    # PEM certificate chain this process presents (as a server, and as a client to cluster
    # listeners) and its private key (a path: the key itself never travels through flags).
    # A plain client of the public API needs neither, only `ca`.
    cert: str | None = None
    key: str | None = None
    ca: str | None = None  # PEM CA that peers' certificates must chain to; None = system roots
    # The name certificates are checked against when dialing, instead of the host dialed: one
    # certificate for a pool whose addresses change (pod IPs) names the pool, not each pod.
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for what in ("cert", "key", "ca"):
            path = getattr(self, what)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--tls-{what}: no such file: {path}")

    def _read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return read(self.key), read(self.cert), read(self.ca)

    # -- gRPC --------------------------------------------------------------------------------
    def server_credentials(self, client_auth: bool) -> grpc.ServerCredentials:
        """`client_auth`: require a client certificate signed by the CA (mutual TLS)."""
        key, cert, ca = self._read()
        if key is None or cert is None:
            raise ValueError("a TLS listener needs --tls-cert and --tls-key")
        if client_auth and ca is None:
            raise ValueError("mutual TLS needs --tls-ca (the CA client certificates chain to)")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca if client_auth
                                           else None, require_client_auth=client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        key, cert, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    # -- HTTP (uvicorn, Prometheus) ------------------------------------------------------------
    def client_context(self) -> ssl.SSLContext:
        """For HTTPS clients (the tests; `bench` over TLS is planned): verify the server against the
        CA."""
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert and self.key:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


def add_port(server: grpc.aio.Server, address: str, tls: TLSConfig | None,
             client_auth: bool) -> int:
    """Bind `address` on `server`, with TLS when configured; returns the port."""
    if tls is None:
        warn_if_exposed(address.rsplit(":", 1)[0], "gRPC")
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials(client_auth))


def aio_channel(address: str, tls: TLSConfig | None,
                options: list[tuple[str, object]] | None = None) -> grpc.aio.Channel:
    opts = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                   options=opts + tls.channel_options())


def sync_channel(address: str, tls: TLSConfig | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            return False


def warn_if_exposed(host: str, what: str) -> None:
    """Plaintext is the laptop default; on an address others can reach it is worth a warning."""
    if not is_loopback(host):
        log.warning("%s listener on %s without TLS: traffic (and credentials) travel in clear; "
                    "pass --tls-cert/--tls-key (docs/security.md)", what, host)
