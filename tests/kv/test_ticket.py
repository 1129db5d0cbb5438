"""The transfer ticket: one record, lossless through both edges, refused when insane."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.kv.ticket import KVTicket, TransferId, produce_params, produced_transfer_id
from splitserve.v1 import common_pb2

TICKET = KVTicket(TransferId("req-1-ab12cd34"), "prefill-0", "10.0.0.7", 40123, (5, 9, 2), 300,
                  1_900_000_000.25, "0123456789abcdef")


def test_round_trips_through_the_proto_and_vllm() -> None:
    wire = common_pb2.KvTicket.FromString(TICKET.to_proto().SerializeToString())
    assert KVTicket.from_proto(wire) == TICKET
    params = TICKET.to_vllm()
    assert params["do_remote_prefill"] is True
    assert KVTicket.from_vllm(params) == TICKET


def test_every_field_is_carried_by_the_proto() -> None:
    names = {f.name for f in dataclasses.fields(KVTicket)}
    assert names == set(common_pb2.KvTicket.DESCRIPTOR.fields_by_name)


@pytest.mark.parametrize(("change", "needle"), [
    ({"transfer_id": ""}, "transfer_id is empty"),
    ({"host": ""}, "host is empty"),
    ({"port": 0}, "port 0"),
    ({"block_ids": ()}, "block_ids"),
    ({"block_ids": (1, -2)}, "block_ids"),
    ({"num_tokens": 0}, "num_tokens"),
])
def test_insane_tickets_are_refused_naming_the_field(change: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(TICKET, **change)


def test_an_empty_proto_is_not_a_ticket() -> None:
    with pytest.raises(ValueError, match="ticket: "):
        KVTicket.from_proto(common_pb2.KvTicket())


def test_produce_params_carry_the_router_chosen_id() -> None:
    assert produced_transfer_id(produce_params(TransferId("t-9"))) == "t-9"
    assert produced_transfer_id({"do_remote_decode": True}) is None
