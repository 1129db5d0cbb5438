"""Generated protobuf/gRPC stubs: freshness and a real round trip."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import grpc
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location("_splitserve_gen_protos", GEN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen_protos():
    return _load_gen_protos()


def test_generated_stubs_are_not_stale(gen_protos, tmp_path):
    fresh = gen_protos.generate(tmp_path)
    fresh_rel = {p.relative_to(tmp_path) for p in fresh}
    committed_rel = {p.relative_to(REPO_ROOT) for p in gen_protos.generated_files(REPO_ROOT)}

    assert committed_rel == fresh_rel, (
        f"missing: {sorted(map(str, fresh_rel - committed_rel))}, "
        f"extra: {sorted(map(str, committed_rel - fresh_rel))}; "
        "run `python scripts/gen_protos.py`"
    )
    stale = [
        str(rel)
        for rel in sorted(fresh_rel)
        if rel.name != "__init__.py"
        and (tmp_path / rel).read_bytes() != (REPO_ROOT / rel).read_bytes()
    ]
    assert not stale, f"stale generated stubs {stale}; run `python scripts/gen_protos.py`"
    # Every .proto has its three outputs.
    stems = {p.stem for p in gen_protos.proto_files()}
    assert stems == {"common", "generation", "worker", "registry"}


def test_check_mode_passes(gen_protos):
    assert gen_protos.check() == []


def test_tokenize_round_trip():
    from splitserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    class FakeGeneration(generation_pb2_grpc.GenerationServicer):
        async def Tokenize(self, request, context):
            if not request.text:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty text")
            ids = [len(word) for word in request.text.split()]
            if request.add_special_tokens:
                ids.insert(0, 1)
            return generation_pb2.TokenizeResponse(token_ids=ids, max_model_len=2048)

    async def scenario():
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(FakeGeneration(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        assert port > 0
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                resp = await stub.Tokenize(
                    generation_pb2.TokenizeRequest(text="hello big world", add_special_tokens=True),
                    timeout=10,
                )
                assert list(resp.token_ids) == [1, 5, 3, 5]
                assert resp.max_model_len == 2048

                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await stub.Tokenize(generation_pb2.TokenizeRequest(text=""), timeout=10)
                assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT

                # Unimplemented methods still exist on the stub (wiring check).
                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10)
                assert excinfo.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop(grace=None)

    asyncio.run(scenario())

    # Presence semantics the router relies on.
    sp = common_pb2.SamplingParams()
    assert not sp.HasField("temperature") and not sp.HasField("seed")
    sp.temperature = 0.0
    assert sp.HasField("temperature")
    req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2]))
    assert req.WhichOneof("prompt") == "token_ids"
    assert not req.HasField("request_id")


def test_worker_and_registry_messages():
    from splitserve.v1 import (
        common_pb2,
        registry_pb2,
        registry_pb2_grpc,
        worker_pb2,
        worker_pb2_grpc,
    )

    kv = common_pb2.KvTicket(
        transfer_id="t1",
        engine_id="e0",
        host="10.0.0.1",
        port=5555,
        block_ids=[3, 4],
        num_tokens=200,
        lease_expires_at=1.5e9,
        spec_fingerprint="abc",
    )
    dec = worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2, 3])
    assert not dec.HasField("ticket")  # absent = local prefill
    dec.ticket.CopyFrom(kv)
    decoded = worker_pb2.DecodeRequest.FromString(dec.SerializeToString())
    assert decoded.ticket.spec_fingerprint == "abc"

    stats = worker_pb2.StatsResponse(
        role=registry_pb2.ROLE_DECODE, load=common_pb2.WorkerLoad(free_kv_blocks=7)
    )
    assert stats.load.free_kv_blocks == 7
    assert common_pb2.FinishReason.Name(common_pb2.FINISH_REASON_STOP) == "FINISH_REASON_STOP"

    for cls in (
        worker_pb2_grpc.PrefillWorkerStub,
        worker_pb2_grpc.DecodeWorkerStub,
        registry_pb2_grpc.RegistryStub,
    ):
        assert callable(cls)
