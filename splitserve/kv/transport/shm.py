"""Same-host path: a pull's bytes through the consumer's shared-memory segment, no socket between.

The consumer owns one segment per producer connection, its staging buffer, and offers it in its
hello (name and nonce); a producer that can open it and read the nonce back shares our /dev/shm
(kv/shm.py) and takes the offer, and the connection then has no process group at all: the
producer gathers a pull's blocks straight into the segment and the consumer scatters them
straight out of it, one memory copy on each side.

The side channel's Pull and Pulled are the synchronisation: the producer writes the segment only
between a Pull and its Pulled, the consumer reads it only after the Pulled and before its next
Pull on that connection (it holds the connection's lock throughout). A pull the segment cannot
grow for (/dev/shm full) is Unusable: the consumer connects afresh without this offer.
"""

from __future__ import annotations

import logging

import torch

from splitserve.kv import blocks
from splitserve.kv.shm import MIN_BYTES, NONCE_BYTES, Segment
from splitserve.kv.transfers import Transfer
from splitserve.kv.transport import (
    ConsumerEnd,
    Incoming,
    Kind,
    Offer,
    Place,
    ProducerEnd,
    Staged,
    TransportError,
    Unusable,
)

log = logging.getLogger(__name__)

PATH = "shm"


class ConsumerStaging:
    """The consumer's segment for one producer connection, replaced by a bigger one as needed."""

    def __init__(self) -> None:
        self.segment = Segment.create(MIN_BYTES)
        self.nonce = self.segment.write_nonce()

    def offer(self) -> dict[str, str]:
        """What the hello carries: the producer proves it sees this segment."""
        return {"name": self.segment.name, "nonce": self.nonce}

    def buffer(self, nbytes: int) -> Segment:
        """A segment of at least `nbytes`; OSError when /dev/shm cannot hold a bigger one."""
        seg = self.segment
        if seg.size < nbytes:
            new = Segment.create(max(nbytes, 2 * seg.size))
            seg.close()
            self.segment = seg = new
        return seg

    def close(self) -> None:
        self.segment.close()


class ProducerAttachment:
    """The producer's view of one connection's consumer segment: re-attached when it is
    replaced (a pull names the segment it wants the bytes in)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment

    @classmethod
    def accept(cls, offer: object) -> ProducerAttachment | None:
        """Attach to the hello's offer if it is here and carries the nonce we read; None
        means "not the same host (or namespace)": another path serves the connection."""
        if not isinstance(offer, dict):
            return None
        try:
            seg = Segment.attach(offer.get("name"))  # type: ignore[arg-type]
        except (OSError, ValueError) as e:
            log.info("KV consumer's shared memory is not reachable here (%s)", e)
            return None
        if seg.size < NONCE_BYTES or seg.read_nonce() != offer.get("nonce"):
            seg.close()
            log.info("KV consumer's segment %s holds another nonce", seg.name)
            return None
        return cls(seg)

    def buffer(self, name: object, nbytes: int) -> torch.Tensor:
        if name != self.segment.name:
            seg = Segment.attach(name)  # type: ignore[arg-type]
            self.segment.close()
            self.segment = seg
        return self.segment.tensor(nbytes)

    def close(self) -> None:
        self.segment.close()


class ShmOffer(Offer):
    key, kinds = PATH, (PATH,)

    def __init__(self, place: Place) -> None:
        self.place, self.staging = place, ConsumerStaging()  # OSError: no offer
        self.params = self.staging.offer()

    def taken(self, kind: str, params: dict, link_key: str) -> ConsumerEnd:
        log.info("KV link %s up through shared memory (%s)", link_key, self.staging.segment.name)
        return ShmConsumerEnd(self.staging, self.place)

    def close(self) -> None:
        self.staging.close()


class ShmConsumerEnd(ConsumerEnd):
    def __init__(self, staging: ConsumerStaging, place: Place) -> None:
        self.staging, self.place = staging, place

    def request(self, nbytes: int) -> dict:
        try:
            return {"segment": self.staging.buffer(nbytes).name}  # the producer writes here
        except OSError as e:
            raise Unusable(f"no room in /dev/shm for a {nbytes}-byte KV segment ({e})") from e

    def receive(self, move: dict, nbytes: int) -> Incoming:
        return Incoming(self.place.blocks_of(self.staging.segment.tensor(nbytes)), PATH)

    def close(self) -> None:
        self.staging.close()


class ShmKind(Kind):
    name = PATH

    def accept(self, offers: dict) -> ShmProducerEnd | None:
        attached = ProducerAttachment.accept(offers.get(PATH))
        return ShmProducerEnd(attached, self.place) if attached is not None else None


class ShmProducerEnd(ProducerEnd):
    def __init__(self, attached: ProducerAttachment, place: Place) -> None:
        self.attached, self.place, self.params = attached, place, {}

    def stage(self, t: Transfer, want: list[int], move: dict) -> Staged:
        kv = self.place.kv
        try:
            into = self.attached.buffer(move.get("segment"), blocks.staging_bytes(kv, len(want)))
        except (OSError, ValueError) as e:
            raise TransportError(f"consumer's shared memory: {e}") from e
        blocks.gather_held(kv, into, t.block_ids, want, t.snapshot)
        return Staged({}, PATH)  # the bytes are in place: the reply says so

    def close(self) -> None:
        self.attached.close()
