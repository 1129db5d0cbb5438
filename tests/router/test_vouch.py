"""The router passes on only tickets that name the prefill worker it called, and vouches for
them (router/vouch.py); the decode side's check is tested on a live cluster
(tests/e2e/test_security.py)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from router.vouch import VouchingPrefill
from splitserve.credentials import ticket_key
from splitserve.kv.ticket import KVTicket, TransferId
from splitserve.v1 import worker_pb2

KEY = ticket_key("cluster-token")


class _Stub:
    """Answers Prefill with a ticket naming `host:port` of engine `engine_id`."""

    def __init__(self, engine_id: str, host: str, port: int) -> None:
        self.ticket = KVTicket(TransferId("t1"), engine_id, host, port, (1, 2), 40,
                               time.time() + 30, "fp")

    async def Prefill(self, request, **kwargs):
        return worker_pb2.PrefillResponse(first_token_id=7, ticket=self.ticket.to_proto())

    async def Release(self, request, **kwargs):
        return worker_pb2.ReleaseResponse(state="held")


def _prefill(stub) -> worker_pb2.PrefillResponse:
    return asyncio.run(stub.Prefill(worker_pb2.PrefillRequest(request_id="r")))


def test_a_ticket_naming_the_registered_producer_is_vouched_for() -> None:
    resp = _prefill(VouchingPrefill(_Stub("P", "10.0.0.1", 5000), "P", "10.0.0.1:5000", KEY))
    assert KVTicket.from_proto(resp.ticket).vouched_by(KEY)
    assert resp.first_token_id == 7


@pytest.mark.parametrize(("engine_id", "host", "port"), [
    ("P", "10.0.0.9", 5000),  # another host: would make the decode worker dial it
    ("P", "10.0.0.1", 22),  # another port on the same host
    ("Q", "10.0.0.1", 5000),  # another engine
])
def test_a_ticket_naming_anything_else_is_a_failed_prefill(engine_id, host, port) -> None:
    stub = VouchingPrefill(_Stub(engine_id, host, port), "P", "10.0.0.1:5000", KEY)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _prefill(stub)
    assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "not vouched for" in e.value.details()
    # Its other RPCs pass through: the router releases the transfer it will not use.
    assert asyncio.run(stub.Release(worker_pb2.ReleaseRequest(transfer_id="t1"))).state == "held"


def test_without_a_cluster_credential_tickets_are_checked_but_not_vouched() -> None:
    resp = _prefill(VouchingPrefill(_Stub("P", "10.0.0.1", 5000), "P", "10.0.0.1:5000", None))
    assert resp.ticket.voucher == ""
    with pytest.raises(grpc.aio.AioRpcError):
        _prefill(VouchingPrefill(_Stub("P", "10.0.0.9", 5000), "P", "10.0.0.1:5000", None))
