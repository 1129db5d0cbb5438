"""One side-channel connection's way for the bulk bytes, on either end.

The bytes travel through a pair channel (any two hosts) or, when the consumer's shared-memory
segment was taken in the handshake (same host), through that segment; a link has one of the
two. The consumer's link also owns its side-channel socket: it keeps one per producer and
drops both together; the producer's server loop owns its socket itself.
"""

from __future__ import annotations

import socket
from typing import Generic, TypeVar

from splitserve.kv.pair_channel import PairChannel
from splitserve.kv.shm import ConsumerStaging, ProducerAttachment

Shm = TypeVar("Shm", ConsumerStaging, ProducerAttachment)


class Link(Generic[Shm]):
    def __init__(self, chan: PairChannel | None, shm: Shm | None,
                 sock: socket.socket | None = None) -> None:
        assert (chan is None) != (shm is None), "a link is a pair channel or shared memory"
        self.chan, self.shm, self.sock = chan, shm, sock

    @property
    def broken(self) -> bool:
        return self.chan is not None and self.chan.closed

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()
        if self.shm is not None:
            self.shm.close()
        if self.sock is not None:
            self.sock.close()
