"""The credentials of a local cluster (`splitserve up`): made fresh for each run, given to the
children through their environment (never argv), each child getting only what it needs.

  cluster credential  $SPLITSERVE_CLUSTER_TOKEN if set, else generated: router and workers.
  KV secret           $SPLITSERVE_KV_SECRET / --kv-secret-file if set, else generated: workers.
  API key(s)          only if the user gave some ($SPLITSERVE_API_KEY / --api-key-file): the
                      router (clients must know them, so `up` cannot invent them).
  TLS (--tls)         a throwaway CA and certificate (deploy/certs.py) in a private temporary
                      directory, removed when the cluster stops; paths as flags.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from deploy import security_flags as sec
from splitserve.credentials import API_KEY_ENV, CLUSTER_TOKEN_ENV, KV_SECRET_ENV, read_secret
from splitserve.tls import TLSConfig


@dataclass(frozen=True)
class LocalSecurity:
    cluster_token: str = field(repr=False)
    kv_secret: str = field(repr=False)
    tls: TLSConfig | None = None
    tls_dir: Path | None = None

    def env(self, router: bool) -> dict[str, str]:
        """A child's environment: ours, plus its secrets, minus those it has no use for."""
        env = {k: v for k, v in os.environ.items() if k not in (KV_SECRET_ENV, API_KEY_ENV)}
        env[CLUSTER_TOKEN_ENV] = self.cluster_token
        if router:
            if API_KEY_ENV in os.environ:
                env[API_KEY_ENV] = os.environ[API_KEY_ENV]
        else:
            env[KV_SECRET_ENV] = self.kv_secret
        return env

    def args(self) -> list[str]:
        """TLS flags for every component (paths, not secrets)."""
        t = self.tls
        return [] if t is None else ["--tls-cert", t.cert, "--tls-key", t.key, "--tls-ca", t.ca]

    def cleanup(self) -> None:
        if self.tls_dir is not None:
            shutil.rmtree(self.tls_dir, ignore_errors=True)


def local_security(a: argparse.Namespace) -> LocalSecurity:
    token = read_secret(CLUSTER_TOKEN_ENV, None) or secrets.token_urlsafe(32)
    kv = sec.kv_secret_of(a) or secrets.token_urlsafe(32)
    if not a.tls:
        return LocalSecurity(token, kv)
    from deploy.certs import write_local_ca  # `cryptography` only when asked for

    directory = Path(tempfile.mkdtemp(prefix="splitserve-tls-"))
    return LocalSecurity(token, kv, write_local_ca(directory), directory)
