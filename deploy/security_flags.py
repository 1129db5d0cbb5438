"""The security flags of every `splitserve` command, and their conversion to config (cli.py).

Secrets are read from environment variables or files, never from the command line: a value
flag there is readable by every user of the host (`ps`, /proc/PID/cmdline). The old value
flags (`--api-key`, `--kv-secret`) still parse, to refuse with a message saying what to use.
Certificate paths are not secrets and are flags.

On an address others can reach, a component without the credentials that keep strangers out
(the cluster credential; the KV secret for KV channels) refuses to start: plaintext on loopback
is the laptop default, plaintext and open elsewhere is a mistake (docs/security.md).
"""

from __future__ import annotations

import argparse

from splitserve.credentials import (
    API_KEY_ENV,
    CLUSTER_TOKEN_ENV,
    KV_SECRET_ENV,
    read_secret,
    read_secrets,
)
from splitserve.tls import TLSConfig, is_loopback


class _Refuse(argparse.Action):
    """A flag that used to take a secret value: refuse it and say what to use instead."""

    def __init__(self, option_strings, dest, instead: str, **kwargs) -> None:
        self.instead = instead
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} would put a secret on the command line, where every user "
                     f"of this host can read it (ps); use {self.instead}")


def add_tls(p: argparse.ArgumentParser, client_only: bool = False) -> None:
    g = p.add_argument_group("TLS (docs/security.md)")
    if client_only:
        g.add_argument("--tls", action="store_true",
                       help="connect with TLS (implied by --tls-ca; system roots without it)")
    else:
        g.add_argument("--tls-cert", default=None,
                       help="PEM certificate (chain) to serve with and present to peers")
        g.add_argument("--tls-key", default=None, help="its PEM private key")
    g.add_argument("--tls-ca", default=None,
                   help="PEM CA to verify peers with; servers of cluster ports then require "
                        "client certificates signed by it (mutual TLS)")
    g.add_argument("--tls-server-name", default=None,
                   help="name to check servers' certificates against instead of the host dialed")


def tls_of(a: argparse.Namespace) -> TLSConfig | None:
    cert, key = getattr(a, "tls_cert", None), getattr(a, "tls_key", None)
    if cert is None and key is None:
        if a.tls_ca is None and not getattr(a, "tls", False):
            return None
        if hasattr(a, "tls_cert"):
            raise ValueError("--tls-ca without --tls-cert/--tls-key: a server needs its "
                             "certificate")
    return TLSConfig(cert=cert, key=key, ca=a.tls_ca, server_name=a.tls_server_name)


def add_api_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help=f"API key(s), one a line (default ${API_KEY_ENV}); servers require "
                        f"`Authorization: Bearer KEY` on /v1/* and gRPC Generation")
    p.add_argument("--api-key", action=_Refuse, instead=f"${API_KEY_ENV} or --api-key-file")


def api_keys_of(a: argparse.Namespace) -> tuple[str, ...]:
    return read_secrets(API_KEY_ENV, a.api_key_file)


def add_cluster_token(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster-token-file", default=None, metavar="PATH",
                   help=f"the cluster credential, apart from API keys (default "
                        f"${CLUSTER_TOKEN_ENV}): required to register with the router and to "
                        f"call workers")


def cluster_token_of(a: argparse.Namespace) -> str | None:
    return read_secret(CLUSTER_TOKEN_ENV, a.cluster_token_file)


def add_kv_secret(g) -> None:
    g.add_argument("--kv-secret-file", default=None, metavar="PATH",
                   help=f"shared secret KV peers prove to each other (default ${KV_SECRET_ENV})")
    g.add_argument("--kv-secret", action=_Refuse, instead=f"${KV_SECRET_ENV} or --kv-secret-file")


def kv_secret_of(a: argparse.Namespace) -> str | None:
    return read_secret(KV_SECRET_ENV, a.kv_secret_file)


def require_on_network(host: str, what: str, secret: object, how: str) -> None:
    """Refuse to listen on a non-loopback `host` without `secret`."""
    if not secret and not is_loopback(host):
        raise ValueError(f"{what} on {host} without {how}: anyone who can reach it could use it "
                         f"(docs/security.md)")
