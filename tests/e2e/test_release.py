"""Held KV is released by the router whenever it will not decode a prefilled request.

Each case leaves a ticket unpulled: without the router's Release the prefill worker would hold
the KV for its whole lease (30 s here), so every test waits, after the client's call ended, until
the prefill workers hold nothing any more, and checks that the transfer ended *released* —
neither sent (nobody pulled) nor expired. Routers S and X (conftest) make the decode side fail to
pull: S's decode worker stalls every Decode for a minute before its engine sees it, X "decodes"
on a colocated worker, which refuses tickets.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from splitserve.roles import Role
from splitserve.v1 import common_pb2
from tests.e2e.cluster import ProcCluster
from tests.e2e.test_serving import _request, _stream
from tests.utils import make_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leak_check")]
LEASE_S = 30  # the workers' default KV lease: an unreleased transfer expires after it


def _transfers(cl: ProcCluster) -> Counter:
    """Transfers by state, summed over the live prefill workers."""
    total: Counter = Counter()
    for p in cl.procs:
        if p.role is Role.PREFILL and p.popen.poll() is None:
            total.update(cl.worker_stats(p).kv_transfers)
    return total


def _assert_released(cl: ProcCluster, before: Counter) -> None:
    """Waits on the event itself: the held KV ends either *released* (the router's Release) or
    *expired* (its lease ran out: the router never released it, the failure this catches). The
    state says which, so no clock is asked; the wait's limit only guards against a hang."""
    deadline = time.monotonic() + LEASE_S + 60
    while True:
        now = _transfers(cl)
        assert now["expired"] == before["expired"], (
            f"the lease expired: the router never released the KV: {dict(now)}")
        if now["held"] == now["claimed"] == 0 and now["released"] == before["released"] + 1:
            break
        assert time.monotonic() < deadline, f"KV still held: {dict(now)}"
        time.sleep(0.02)
    assert now["sent"] == before["sent"] and now["expired"] == before["expired"]


def test_stop_string_in_the_first_token(cl: ProcCluster, tiny_model_dir: Path) -> None:
    stub = cl.generation(cl.by_name["A"])
    # A prompt whose first generated token has visible text, to use as the stop string.
    for seed in range(20):
        (ids,) = make_prompts(tiny_model_dir, [200], seed=100 + seed)
        first = stub.Complete(_request(ids, max_tokens=1), timeout=60).text
        if first.strip():
            break
    else:
        pytest.fail("no prompt whose first token has text")
    before = _transfers(cl)
    resp = stub.Complete(_request(ids, max_tokens=30, stop=[first]), timeout=60)
    assert resp.finish_reason == common_pb2.FINISH_REASON_STOP and resp.stop_reason == first
    assert resp.usage.completion_tokens == 1  # decided on the prefill worker's token alone
    _assert_released(cl, before)


def test_client_gone_after_the_first_token(cl: ProcCluster, tiny_model_dir: Path) -> None:
    (ids,) = make_prompts(tiny_model_dir, [300], seed=31)
    before = _transfers(cl)
    call = cl.generation(cl.by_name["S"]).Generate(_request(ids, max_tokens=50), timeout=120)
    first = next(call)  # the prefill worker's token; the Decode now stalls on DS
    assert len(first.token_ids) == 1
    call.cancel()
    _assert_released(cl, before)
    assert cl.outcomes("S").get("cancelled", 0) >= 1


def test_deadline_before_the_pull(cl: ProcCluster, tiny_model_dir: Path) -> None:
    (ids,) = make_prompts(tiny_model_dir, [250], seed=32)
    before = _transfers(cl)
    deadlines = cl.outcomes("S").get("deadline", 0)
    with pytest.raises(grpc.RpcError) as e:
        _stream(cl.generation(cl.by_name["S"]), _request(ids, max_tokens=50), timeout=5.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _assert_released(cl, before)
    assert cl.outcomes("S")["deadline"] == deadlines + 1


def test_decode_failed_before_pulling(cl: ProcCluster, tiny_model_dir: Path) -> None:
    (ids,) = make_prompts(tiny_model_dir, [260], seed=33)
    before = _transfers(cl)
    with pytest.raises(grpc.RpcError) as e:
        _stream(cl.generation(cl.by_name["X"]), _request(ids, max_tokens=20), timeout=60)
    assert "cannot pull KV" in e.value.details()
    _assert_released(cl, before)


def test_release_rpc_reports_what_it_freed(cl: ProcCluster) -> None:
    """Called directly: idempotent, and an unknown id is remembered rather than refused."""
    from splitserve.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(cl.by_name["P0"].address) as ch:
        stub = worker_pb2_grpc.PrefillWorkerStub(ch)
        rel = worker_pb2.ReleaseRequest(transfer_id="never-held")
        assert stub.Release(rel, timeout=10).state == "unknown"
        assert stub.Release(rel, timeout=10).state == "released"  # the remembered tombstone
        with pytest.raises(grpc.RpcError) as e:
            stub.Release(worker_pb2.ReleaseRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_golden_lengths_still_transfer_once(cl: ProcCluster, tiny_model_dir: Path) -> None:
    """A decode that pulls consumes the ticket: no release is sent for it (sent, not released)."""
    before = _transfers(cl)
    prompts = make_prompts(tiny_model_dir, [127, 128, 129], seed=34)
    stub = cl.generation(cl.by_name["B"])
    for ids in prompts:
        assert len(_stream(stub, _request(ids, max_tokens=4))[0]) == 4
    after = _transfers(cl)
    assert after["sent"] - before["sent"] == 3 and after["released"] == before["released"]
