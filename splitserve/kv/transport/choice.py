"""Which paths each side offers or takes, best first: the one place that knows them all.

A consumer offers the same-host path (with the arena's reading) when its cache is on the CPU,
settings allow it and /dev/shm exists, and always the pair channel; a producer takes the first
of its kinds that accepts the offers. Either side's `transport="pair"` keeps to the pair channel.
"""

from __future__ import annotations

import logging

from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.transport import Kind, Offer, Place, ProducerEnd
from splitserve.kv.transport.arena import ArenaKind, ArenaOffer
from splitserve.kv.transport.pair import PairKind, PairOffer
from splitserve.kv.transport.shm import ShmKind

log = logging.getLogger(__name__)


def consumer_offers(settings: ConnectorSettings, place: Place, producer_host: str,
                    skip: set[str]) -> list[Offer]:
    """This side's offers to the producer at `producer_host`, but none keyed in `skip` (paths
    that proved unusable there)."""
    offers: list[Offer] = []
    if ArenaOffer.key not in skip and settings.shares_memory(place.device.type):
        try:
            offers.append(ArenaOffer(place))
        except OSError as e:
            log.warning("no shared-memory KV segment (%s): the pair channel", e)
    offers.append(PairOffer(place, producer_host))
    return offers


def producer_kinds(settings: ConnectorSettings, place: Place, copy_out: bool) -> list[Kind]:
    kinds: list[Kind] = []
    if settings.shares_memory(place.device.type):
        kinds.append(ArenaKind(place, settings.hold_arena_mib << 20)
                     if copy_out and settings.hold_arena_mib else ShmKind(place))
    kinds.append(PairKind(place))
    return kinds


def choose(kinds: list[Kind], offers: dict) -> tuple[str, ProducerEnd] | None:
    """The first kind that accepts `offers`, and its end."""
    for kind in kinds:
        end = kind.accept(offers)
        if end is not None:
            return kind.name, end
    return None
