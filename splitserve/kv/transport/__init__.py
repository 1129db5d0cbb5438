"""The transport seam: how a pull's bytes get from the producer's cache to the consumer's.

consumer.py and producer.py own a transfer's lifecycle and speak only to the interface below;
each path is one module that implements it:
  pair.py    a 2-rank gloo/NCCL process group per connection: any two hosts.
  shm.py     the consumer's shared-memory segment: one host (and IPC namespace).
  arena.py   the producer's shared hold arena: one host, copy-out holds read where they lie.
  choice.py  which paths each side offers or accepts, in order of preference.

A connection's life, on both ends (the messages: messages.py; the handshake: handshake.py):
  offer     the consumer makes an `Offer` per path it can take, with what that path needs made
            now (a segment, say); the hello carries their `params` under their `key`.
  accept    the producer asks its `Kind`s in order of preference; the first that accepts the
            offers gives a `ProducerEnd`, whose `params` the welcome carries (under the
            producer's proof). The consumer's offer, `taken`, becomes its `ConsumerEnd`; the
            others close. Then both ends `open` (a process group needs both sides at once).
  move      per pull: the consumer's `request` gives the Pull's `move` fields; the producer's
            `stage` puts the bytes where they go and gives a `Staged` (its reply's fields, then
            `send` for what follows the reply); the consumer's `receive` gives the `Incoming`
            bytes to scatter, and when `landed` is set, the producer waits for a Landed message
            after the scatter before it lets go of them.
  close     when the connection ends or breaks; an end whose link failed says `broken`.

CUDA IPC fits the same shape: the producer exports its cache once per connection (the welcome's
params), each Pulled names the held blocks and an IPC event their gather recorded, the consumer's
`receive` waits on that event and returns the remote blocks as its source, and `landed` makes the
producer keep them until the consumer's scatter is done. An end whose bytes arrive layer by layer
would give an `Incoming` whose source fills in layer order behind an event per layer; the ones
here deliver whole pulls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from splitserve.kv import blocks

if TYPE_CHECKING:
    from splitserve.kv.transfers import Transfer


class TransportError(RuntimeError):
    """A transfer failed or timed out; an end whose link it broke says `broken`."""


class Unusable(TransportError):
    """This path cannot take the pull (no room for it): connect afresh without offering it."""


@dataclass(frozen=True)
class Place:
    """What an end works on: this side's KV cache, the address it binds, every wait's bound."""

    kv: dict[str, torch.Tensor]
    host: str
    timeout_s: float

    @property
    def device(self) -> torch.device:
        return next(iter(self.kv.values())).device

    def blocks_of(self, raw: torch.Tensor) -> torch.Tensor:
        """Staging bytes (uint8, whole blocks) as a staging view of this cache's blocks."""
        return blocks.staging_view(raw, self.kv, raw.numel() // blocks.staging_bytes(self.kv, 1))


@dataclass(slots=True)
class Incoming:
    src: torch.Tensor  # the pull's blocks as a staging view, [layers, blocks, words]
    path: str  # for the stats: which way the bytes came
    landed: bool = False  # the producer keeps them for us until we say Landed


@dataclass(slots=True)
class Staged:
    reply: dict  # the Pulled message's `move` fields
    path: str
    send: Callable[[], None] = lambda: None  # after the reply: the bytes' own way, if any
    landed: bool = False  # the consumer reads the bytes where they lie: wait for Landed


@dataclass(frozen=True, slots=True)
class Held:
    """A copy-out hold's bytes, in memory a `Kind` lent; `free` gives it back."""

    tensor: torch.Tensor
    free: Callable[[], None]
    where: object = None  # what the lending path needs to find the bytes again


class ConsumerEnd(ABC):
    def request(self, nbytes: int) -> dict:
        """The Pull's `move` fields for a pull of `nbytes`; Unusable when it cannot take it."""
        return {}

    @abstractmethod
    def receive(self, move: dict, nbytes: int) -> Incoming:
        """The pulled bytes, once the producer's reply (its `move` fields) is in."""

    @property
    def broken(self) -> bool:
        return False

    def close(self) -> None:
        return None


class Offer(ABC):
    key: ClassVar[str]  # the hello's name for it
    kinds: ClassVar[tuple[str, ...]]  # the producer paths that can take it
    params: dict

    @abstractmethod
    def taken(self, kind: str, params: dict, link_key: str) -> ConsumerEnd:
        """The producer chose `kind` with `params` (its proof checked): the open end."""

    def close(self) -> None:
        """Not taken (or the handshake failed): let go of what the offer made."""
        return None


class ProducerEnd(ABC):
    params: dict  # what the welcome tells the consumer

    def open(self, link_key: str) -> None:
        """After the welcome is sent: join the consumer (a process group needs both sides)."""
        return None

    @abstractmethod
    def stage(self, t: Transfer, want: list[int], move: dict) -> Staged:
        """Put blocks `want` of `t` where the consumer will read them (the Pull's `move`
        fields say where, for paths that need it)."""

    def close(self) -> None:
        return None


class Kind(ABC):
    """One path, on the producer's side, for the producer's life."""

    name: ClassVar[str]

    def __init__(self, place: Place) -> None:
        self.place = place

    @abstractmethod
    def accept(self, offers: dict) -> ProducerEnd | None:
        """An end for a consumer that offers `offers`, or None when this path cannot serve it."""

    def hold_space(self, nbytes: int) -> Held | None:
        """Room for a copy-out hold where this path serves it best, or None (private memory)."""
        return None

    def close(self) -> None:
        return None
