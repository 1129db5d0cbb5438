"""The producer's status board: its transfer counts in a small shared file, readable at no cost.

The producer runs in vLLM's worker process; the prefill worker's server (heartbeats, Stats,
/metrics) runs in the API process. Asking across (vLLM's `collective_rpc`) wakes the worker, and
on a CPU host a woken vLLM worker busy-polls its message queue for a second, taking a core from
the engines beside it: polled every heartbeat, that starved co-located engines. vLLM's own stats
path is free but arrives only with engine steps, so an idle engine would report a transfer as
held long after a side-channel thread sent it. So the producer writes its counts into a
memory-mapped file after every change, and the server reads them whenever it likes.

Layout: little-endian int64s — a sequence number (odd while a write is in progress; a
reader retries until it sees the same even number before and after), then the counts. One writer
(the producer, under its book's lock), any number of readers.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from splitserve.kv.transfers import TransferState

# A count per transfer state (its label: one spelling, the enum's), then the blocks held.
FIELDS = (*(s.label for s in TransferState), "held_blocks")
_FMT = struct.Struct(f"<{1 + len(FIELDS)}q")
_SEQ = struct.Struct("<q")


class BoardWriter:
    def __init__(self, path: str | Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _FMT.size)
            self._map = mmap.mmap(fd, _FMT.size)
        finally:
            os.close(fd)
        self._seq = 0
        self.publish(dict.fromkeys(FIELDS, 0))

    def publish(self, counts: dict[str, int]) -> None:
        self._seq += 1  # odd: a write is in progress, readers retry
        self._map[:8] = _SEQ.pack(self._seq)
        self._map[8:] = _FMT.pack(0, *(int(counts.get(k, 0)) for k in FIELDS))[8:]
        self._seq += 1  # even again: the counts are whole
        self._map[:8] = _SEQ.pack(self._seq)

    def close(self) -> None:
        self._map.close()


def read_board(path: str | Path) -> dict[str, int]:
    """The counts as last published; {} when there is no board (yet)."""
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), _FMT.size, access=mmap.ACCESS_READ)
    except (FileNotFoundError, ValueError):  # ValueError: still empty (being created)
        return {}
    with m:
        while True:
            seq, *values = _FMT.unpack(m[:])
            if seq % 2 == 0 and _SEQ.unpack(m[:8])[0] == seq:
                return dict(zip(FIELDS, values))
