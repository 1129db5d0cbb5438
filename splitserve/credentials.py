"""Who may call what: client API keys, the cluster credential, and how both are read.

Two kinds of secret, never interchangeable:
  API keys            clients of the public `Generation` service and the HTTP `/v1` API.
  cluster credential  components of one cluster: the `Registry` (workers joining the router) and
                      the worker services (`PrefillWorker`, `DecodeWorker`: the router calling
                      them). A client's key cannot register a worker or call one, and a worker
                      without the credential cannot register.
Both travel as `authorization: Bearer <secret>` and are compared in constant time, once per
call (a decode session is one call however many tokens it carries). Health and reflection stay
open: probes must work without secrets, and they reveal nothing about requests.

Secrets come from environment variables or files, never from a command line, where every user
of the host can read them (`ps`, /proc/PID/cmdline).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

# Every secret's variable is named here; the KV one is defined beside its use in the engine.
from splitserve.kv.settings import KV_SECRET_ENV  # noqa: F401

API_KEY_ENV = "SPLITSERVE_API_KEY"
CLUSTER_TOKEN_ENV = "SPLITSERVE_CLUSTER_TOKEN"

PUBLIC_SERVICES = ("/splitserve.v1.Generation/",)
CLUSTER_SERVICES = ("/splitserve.v1.Registry/", "/splitserve.v1.PrefillWorker/",
                    "/splitserve.v1.DecodeWorker/")


def read_secrets(env: str, path: str | None) -> tuple[str, ...]:
    """The secrets in file `path` (one a line: several allow a rotation), else `$env`; () when
    neither is set. A file or variable that is set but empty is an error, not "no secret"."""
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"cannot read secret file {path}: {e.strerror}") from e
        where = path
    elif os.environ.get(env) is not None:
        text, where = os.environ[env], f"${env}"
    else:
        return ()
    values = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not values:
        raise ValueError(f"{where} is set but holds no secret")
    return values


def read_secret(env: str, path: str | None) -> str | None:
    """One secret (the first line of the file), or None."""
    values = read_secrets(env, path)
    return values[0] if values else None


def matches(header: str | None, secrets: Iterable[str]) -> bool:
    """Whether `header` is `Bearer <one of secrets>`. Constant time in the secret compared:
    every candidate is compared in full, so timing tells nothing about how much matched."""
    got = (header or "").encode()
    ok = False
    for s in secrets:
        ok |= hmac.compare_digest(got, f"Bearer {s}".encode())
    return ok


def bearer(secret: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `secret` (none when there is no secret)."""
    return (("authorization", f"Bearer {secret}"),) if secret else ()


@dataclass(frozen=True)
class Access:
    """What a gRPC server accepts. Empty means open (the laptop default)."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    cluster_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.cluster_token and self.cluster_token in self.api_keys:
            raise ValueError("the cluster credential must differ from every API key: a client "
                             "holding it could register workers")

    def interceptor(self) -> AuthInterceptor | None:
        return AuthInterceptor(self) if self.api_keys or self.cluster_token else None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Per call: the public service wants an API key, the cluster services the cluster
    credential; anything else (health, reflection) passes."""

    def __init__(self, access: Access) -> None:
        self._rules = [(PUBLIC_SERVICES, access.api_keys, "API key"),
                       (CLUSTER_SERVICES, (access.cluster_token,) if access.cluster_token
                        else (), "cluster credential")]

    async def intercept_service(self, continuation, details):
        for prefixes, secrets, what in self._rules:
            if details.method.startswith(prefixes):
                if secrets:
                    md = details.invocation_metadata or ()
                    header = next((v for k, v in md if k == "authorization"), None)
                    if not matches(header, secrets):
                        handler = await continuation(details)
                        return _refusal(handler, f"invalid or missing {what}")
                break
        return await continuation(details)


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as the real one that answers UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover

    if handler is None:  # unknown method: let grpc answer UNIMPLEMENTED... after auth
        return grpc.unary_unary_rpc_method_handler(unary)
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(stream if handler.response_streaming else unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class WithMetadata:
    """A stub whose every call carries `metadata` (the cluster credential): call sites stay
    as they are, and a stream pays for it once, not per message."""

    def __init__(self, stub: object, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)
        return functools.partial(method, metadata=self._metadata) if self._metadata else method


def with_token(stub: object, token: str | None) -> object:
    return WithMetadata(stub, bearer(token)) if token else stub


def ticket_key(cluster_token: str | None) -> bytes | None:
    """The key routers vouch for KV tickets with (kv/ticket.py), derived from the cluster
    credential so that no further secret needs distributing."""
    if not cluster_token:
        return None
    return hmac.new(cluster_token.encode(), b"splitserve ticket voucher v1",
                    hashlib.sha256).digest()
