"""Every listener refuses what it should, with the status it should: a real router process with
TLS, a cluster port (mutual TLS), API keys and a cluster credential; the real worker server
(`build_server`) around a stand-in decode servicer; the real registration loop. No engine.

Refusals: no TLS or a certificate from another CA → the handshake fails (UNAVAILABLE, or a
connection error over HTTP); no key, a wrong one, or the other kind of secret → UNAUTHENTICATED
(401 over HTTP). See docs/security.md for the threat model these tests stand for.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from deploy.certs import write_local_ca
from deploy.procs import ProcessSet
from splitserve.credentials import API_KEY_ENV, CLUSTER_TOKEN_ENV, bearer, read_secrets
from splitserve.tls import TLSConfig, aio_channel, sync_channel
from splitserve.v1 import generation_pb2, generation_pb2_grpc, registry_pb2, registry_pb2_grpc

API_KEY, TOKEN = "client-key-1", "cluster-token-1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, TLSConfig]:
    d = tmp_path_factory.mktemp("pki")
    ours, foreign = write_local_ca(d / "ours"), write_local_ca(d / "foreign")
    return {"ours": ours, "foreign": foreign,
            "ca_only": TLSConfig(ca=ours.ca),  # a public client: trusts the CA, has no cert
            "foreign_cert": TLSConfig(cert=foreign.cert, key=foreign.key, ca=ours.ca)}


@pytest.fixture(scope="module")
def router(tiny_model_dir: Path, pki, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    t = pki["ours"]
    procs = ProcessSet(log_dir=logs, env={**os.environ, API_KEY_ENV: API_KEY,
                                          CLUSTER_TOKEN_ENV: TOKEN})
    p = procs.spawn("router", ["router", "--model", str(tiny_model_dir), "--grpc-port", "0",
                               "--cluster-port", "0", "--http-port", "0", "--tls-cert", t.cert,
                               "--tls-key", t.key, "--tls-ca", t.ca])
    try:
        procs.wait_ready([p], 60)
        yield p.endpoints
    finally:
        procs.stop(grace_s=10)


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _list_models(address: str, tls: TLSConfig | None, key: str | None) -> grpc.StatusCode:
    with sync_channel(address, tls) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        return _code(lambda: stub.ListModels(generation_pb2.ListModelsRequest(), timeout=5,
                                             metadata=bearer(key)))


def _register(address: str, tls: TLSConfig | None, secret: str | None,
              worker_id: str = "intruder") -> grpc.StatusCode:
    req = registry_pb2.RegisterRequest(worker_id=worker_id, role=registry_pb2.ROLE_DECODE,
                                       grpc_address="127.0.0.1:1", model="tiny")
    with sync_channel(address, tls) as ch:
        stub = registry_pb2_grpc.RegistryStub(ch)
        code = _code(lambda: stub.Register(req, timeout=5, metadata=bearer(secret)))
        if code is grpc.StatusCode.OK:
            stub.Deregister(registry_pb2.DeregisterRequest(worker_id=worker_id), timeout=5,
                            metadata=bearer(secret))
        return code


def test_public_grpc_wants_tls_and_an_api_key(router, pki) -> None:
    a, U = router["grpc"], grpc.StatusCode
    assert _list_models(a, None, API_KEY) is U.UNAVAILABLE  # plaintext: no handshake
    assert _list_models(a, TLSConfig(ca=pki["foreign"].ca), API_KEY) is U.UNAVAILABLE
    assert _list_models(a, pki["ca_only"], None) is U.UNAUTHENTICATED
    assert _list_models(a, pki["ca_only"], "wrong") is U.UNAUTHENTICATED
    assert _list_models(a, pki["ca_only"], TOKEN) is U.UNAUTHENTICATED  # not a client key
    assert _list_models(a, pki["ca_only"], API_KEY) is U.OK  # no client certificate needed
    # The Registry lives on the cluster port only.
    assert _register(a, pki["ours"], TOKEN) is U.UNIMPLEMENTED


def test_cluster_port_wants_a_client_certificate_and_the_cluster_credential(router, pki):
    c, U = router["cluster"], grpc.StatusCode
    assert _register(c, None, TOKEN) is U.UNAVAILABLE
    assert _register(c, pki["ca_only"], TOKEN) is U.UNAVAILABLE  # no client certificate
    assert _register(c, pki["foreign_cert"], TOKEN) is U.UNAVAILABLE  # signed by another CA
    assert _register(c, pki["ours"], None) is U.UNAUTHENTICATED
    assert _register(c, pki["ours"], API_KEY) is U.UNAUTHENTICATED  # a client key cannot
    assert _register(c, pki["ours"], TOKEN) is U.OK


def test_http_wants_tls_and_an_api_key(router, pki) -> None:
    url = router["http"]
    assert url.startswith("https://")
    ctx = pki["ca_only"].client_context()

    def get(path: str, key: str | None = None, context: ssl.SSLContext | None = ctx) -> int:
        req = urllib.request.Request(url + path, headers=dict(bearer(key)))
        try:
            return urllib.request.urlopen(req, timeout=10, context=context).status
        except urllib.error.HTTPError as e:
            return e.code

    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext to a TLS port
        urllib.request.urlopen(url.replace("https://", "http://") + "/health", timeout=10)
    with pytest.raises(urllib.error.URLError):  # a server certificate we cannot verify
        get("/v1/models", API_KEY, TLSConfig(ca=pki["foreign"].ca).client_context())
    assert get("/v1/models") == 401
    assert get("/v1/models", "wrong") == 401
    assert get("/v1/models", TOKEN) == 401
    assert get("/v1/models", API_KEY) == 200
    assert get("/metrics") == 200  # open, over TLS


def _worker_cfg(tls: TLSConfig | None, token: str | None, router: str | None = None):
    from splitserve.engine import EngineConfig
    from splitserve.roles import Role
    from splitserve.worker.config import WorkerConfig

    return WorkerConfig(role=Role.DECODE, engine=EngineConfig(model="tiny"), router=router,
                        cluster_token=token, tls=tls, heartbeat_interval_s=0.2)


def test_worker_rpcs_want_a_client_certificate_and_the_cluster_credential(pki) -> None:
    from bench.token_source import TokenSource
    from splitserve.v1 import worker_pb2, worker_pb2_grpc
    from splitserve.worker.core import WorkerCore
    from splitserve.worker.server import build_server

    def add(core, server) -> list[str]:  # the real DecodeWorker service, without an engine
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(TokenSource(0.0, 1, "tiny"), server)
        return ["splitserve.v1.DecodeWorker"]

    async def main() -> None:
        cfg = _worker_cfg(pki["ours"], TOKEN)
        server, port, _, _ = build_server(cfg, WorkerCore(cfg, "tiny"), add)
        await server.start()
        address = f"127.0.0.1:{port}"

        async def stats(tls, key) -> grpc.StatusCode:
            async with aio_channel(address, tls) as ch:
                try:
                    await worker_pb2_grpc.DecodeWorkerStub(ch).Stats(
                        worker_pb2.StatsRequest(), timeout=5, metadata=bearer(key))
                except grpc.aio.AioRpcError as e:
                    return e.code()
                return grpc.StatusCode.OK

        async def session(key) -> grpc.StatusCode:  # the stream the router decodes over
            async with aio_channel(address, pki["ours"]) as ch:
                call = worker_pb2_grpc.DecodeWorkerStub(ch).DecodeSession(
                    metadata=bearer(key), timeout=5)
                try:
                    await call.write(worker_pb2.SessionRequest(start=worker_pb2.DecodeRequest(
                        request_id="r", prompt_token_ids=[1, 2])))
                    await call.read()
                except grpc.aio.AioRpcError as e:
                    return e.code()
                return grpc.StatusCode.OK

        U = grpc.StatusCode
        try:
            assert await stats(None, TOKEN) is U.UNAVAILABLE
            assert await stats(pki["ca_only"], TOKEN) is U.UNAVAILABLE
            assert await stats(pki["foreign_cert"], TOKEN) is U.UNAVAILABLE
            assert await stats(pki["ours"], None) is U.UNAUTHENTICATED
            assert await stats(pki["ours"], API_KEY) is U.UNAUTHENTICATED
            assert await stats(pki["ours"], TOKEN) is U.OK
            assert await session(API_KEY) is U.UNAUTHENTICATED
            assert await session(TOKEN) is U.OK
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_worker_registers_only_with_the_cluster_credential(router, pki) -> None:
    """The real registration loop: with a client's key (or nothing) the router never takes the
    worker; with the credential it does at once."""
    from splitserve.worker.core import WorkerCore
    from splitserve.worker.registration import heartbeat_loop

    def decode_workers() -> int:
        with sync_channel(router["grpc"], pki["ca_only"]) as ch:
            (m,) = generation_pb2_grpc.GenerationStub(ch).ListModels(
                generation_pb2.ListModelsRequest(), timeout=5, metadata=bearer(API_KEY)).models
            return m.decode_workers

    async def attempt(token: str | None, seconds: float) -> int:
        cfg = _worker_cfg(pki["ours"], token, router["cluster"])
        stop = asyncio.Event()
        loop = asyncio.ensure_future(heartbeat_loop(WorkerCore(cfg, "tiny"), router["cluster"],
                                                    f"w-{token}", "127.0.0.1:1", stop))
        seen = 0
        for _ in range(int(seconds / 0.1)):
            await asyncio.sleep(0.1)
            seen = await asyncio.to_thread(decode_workers)
            if seen:
                break
        stop.set()
        await loop
        return seen

    assert asyncio.run(attempt(API_KEY, 2.0)) == 0  # ten heartbeat intervals, never taken
    assert asyncio.run(attempt(None, 1.0)) == 0
    assert asyncio.run(attempt(TOKEN, 10.0)) == 1


def test_secrets_come_from_files_or_the_environment(tmp_path, monkeypatch) -> None:
    f = tmp_path / "keys"
    f.write_text("k1\n\nk2\n")
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert read_secrets(API_KEY_ENV, str(f)) == ("k1", "k2")  # the file wins; rotation
    assert read_secrets(API_KEY_ENV, None) == ("from-env",)
    monkeypatch.setenv(API_KEY_ENV, "")
    with pytest.raises(ValueError, match="holds no secret"):
        read_secrets(API_KEY_ENV, None)
    monkeypatch.delenv(API_KEY_ENV)
    assert read_secrets(API_KEY_ENV, None) == ()


@pytest.mark.parametrize("argv", [["router", "--api-key", "s"], ["prefill", "--kv-secret", "s"],
                                  ["up", "--api-key", "s"], ["generate", "x", "--api-key", "s"]])
def test_secret_value_flags_are_refused(argv, capsys) -> None:
    from deploy.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "every user of this host can read it" in capsys.readouterr().err


def test_an_exposed_component_without_credentials_refuses_to_start(tiny_model_dir, monkeypatch,
                                                                  capsys) -> None:
    from deploy.cli import main

    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)
    assert main(["router", "--model", str(tiny_model_dir), "--host", "0.0.0.0"]) == 2
    assert "without a cluster credential" in capsys.readouterr().err


def test_chat_templates_run_sandboxed() -> None:
    """A model's template is code from wherever the model came from: it must not reach Python
    internals, nor change the request's messages (router/chat.py renders every template)."""
    import jinja2.sandbox

    from router.chat import ChatTemplate
    from router.errors import RequestFailed
    from router.outcome import outcome_of

    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", None, None)
    with pytest.raises(RequestFailed, match="chat template failed") as e:
        escape.render([])
    assert isinstance(e.value.__cause__, jinja2.sandbox.SecurityError)
    assert outcome_of(e.value).http_status == 500  # the model's fault, not the client's
    mutate = ChatTemplate("{% set _ = messages.append({'role': 'x'}) %}{{ messages|length }}",
                          None, None)
    with pytest.raises(RequestFailed) as e:
        mutate.render([("user", "hi")])
    assert isinstance(e.value.__cause__, jinja2.sandbox.SecurityError)
    ok = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}",
                      None, None)
    assert ok.render([("user", "hi")]) == "user: hi"

