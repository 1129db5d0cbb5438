"""The transfer ticket: one record, lossless through both edges, refused when insane."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.kv.ticket import (
    KVTicket,
    TransferId,
    produce_params,
    produced_transfer_id,
    transfer_id_or_new,
)
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
    # No id chosen (a caller other than the router): a fresh one each time, never a shared one.
    a, b = (produced_transfer_id({"do_remote_decode": True}) for _ in range(2))
    assert a != b and len(a) == 32
    assert transfer_id_or_new("") != transfer_id_or_new("") and transfer_id_or_new("x") == "x"


def test_a_voucher_covers_every_field_and_only_its_key() -> None:
    """The router vouches for a ticket (docs/security.md); changing any field (an address to
    dial, blocks to read) or the key breaks the voucher, and the proto carries it intact."""
    t = KVTicket(TransferId("t1"), "P", "10.0.0.1", 5000, (1, 2), 40, 1.5e9 + 0.125, "fp")
    key = b"k" * 32
    v = t.vouch(key)
    assert v.voucher and v.vouched_by(key) and not t.vouched_by(key)
    assert not v.vouched_by(b"x" * 32)
    assert KVTicket.from_proto(v.to_proto()).vouched_by(key)
    assert KVTicket.from_vllm(v.to_vllm()).vouched_by(key)
    for change in ({"transfer_id": "t2"}, {"engine_id": "Q"}, {"host": "10.0.0.2"},
                   {"port": 5001}, {"block_ids": (1, 3)}, {"num_tokens": 41},
                   {"lease_expires_at": 1.5e9 + 1}, {"spec_fingerprint": "other"}):
        assert not dataclasses.replace(v, **change).vouched_by(key), change
