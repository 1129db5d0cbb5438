"""The pair channel as a transport: a pull's bytes over the connection's own 2-rank process group
(gloo between CPU caches, NCCL between CUDA ones; pair_channel.py). Any two hosts.

The producer's `PairKind` hosts the rendezvous store for every pair; the welcome tells its port,
and both ends join the group under the connection's link key once the welcome is out. Per pull:
the consumer names a tag, the producer gathers into its staging buffer (or sends a copy-out hold
as it lies), replies, then sends; the consumer receives into its own staging buffer.
"""

from __future__ import annotations

import itertools

from splitserve.kv import blocks
from splitserve.kv import transport as tp
from splitserve.kv.pair_channel import (
    CONSUMER_RANK,
    PRODUCER_RANK,
    PairChannel,
    connect_store,
    host_store,
)
from splitserve.kv.transfers import Transfer

PATH = "pair"


class PairOffer(tp.Offer):
    key, kinds = PATH, (PATH,)

    def __init__(self, place: tp.Place, producer_host: str) -> None:
        self.place, self.producer_host, self.params = place, producer_host, {}

    def taken(self, kind: str, params: dict, link_key: str) -> PairConsumerEnd:
        port, host = params.get("store_port"), params.get("store_host", self.producer_host)
        if not isinstance(port, int) or not isinstance(host, str):
            raise tp.TransportError(f"the producer's welcome names no store address: {params}")
        p = self.place
        store = connect_store(host, port, p.timeout_s)  # its data plane's address
        return PairConsumerEnd(PairChannel(store, link_key, CONSUMER_RANK, p.device, p.timeout_s,
                                           p.host), p)


class PairConsumerEnd(tp.ConsumerEnd):
    def __init__(self, chan: PairChannel, place: tp.Place) -> None:
        self.chan, self.place = chan, place
        self._tags = itertools.count(1)
        self._tag = 0

    def request(self, nbytes: int) -> dict:
        self._tag = next(self._tags)
        return {"tag": self._tag}

    def receive(self, move: dict, nbytes: int) -> tp.Incoming:
        raw = self.chan.staging(nbytes)  # reused: the next pull waits for this one's scatter
        self.chan.recv(raw, self._tag)
        return tp.Incoming(self.place.blocks_of(raw), PATH)

    @property
    def broken(self) -> bool:
        return self.chan.closed

    def close(self) -> None:
        self.chan.close()


class PairKind(tp.Kind):
    name = PATH

    def __init__(self, place: tp.Place) -> None:
        super().__init__(place)
        self.store = host_store(place.host, 0, place.timeout_s)

    def accept(self, offers: dict) -> PairProducerEnd | None:
        return PairProducerEnd(self) if PATH in offers else None


class PairProducerEnd(tp.ProducerEnd):
    def __init__(self, kind: PairKind) -> None:
        self.kind = kind
        self.params = {"store_host": kind.place.host, "store_port": kind.store.port}
        self.chan: PairChannel | None = None

    def open(self, link_key: str) -> None:
        p = self.kind.place
        self.chan = PairChannel(self.kind.store, link_key, PRODUCER_RANK, p.device, p.timeout_s,
                                p.host)

    def stage(self, t: Transfer, want: list[int], move: dict) -> tp.Staged:
        tag, chan = move.get("tag"), self.chan
        if not isinstance(tag, int):
            raise tp.TransportError(f"a pull over the pair channel without a tag: {move}")
        assert chan is not None
        whole = t.snapshot is not None and want == t.block_ids
        nbytes = blocks.staging_bytes(self.kind.place.kv, len(want))
        raw = blocks.gather_held(self.kind.place.kv, None if whole else chan.staging(nbytes),
                                 t.block_ids, want, t.snapshot)
        return tp.Staged({}, PATH, send=lambda: chan.send(raw, tag))

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()
