"""The producer's shared hold arena (transport/arena.py): its allocator, on a real /dev/shm
segment. Pulls out of it, with a real producer process and consumer: test_transport_shm.py and
test_transport_conformance.py."""

from __future__ import annotations

import os

import pytest
import torch

from splitserve.kv import shm
from splitserve.kv.transport import arena as arena_mod
from splitserve.kv.transport.arena import ARENA_ALIGN


def test_spans_are_aligned_apart_and_coalesce_when_freed() -> None:
    arena = arena_mod.HoldArena(shm.MIN_BYTES)
    try:
        size = arena.segment.size
        a, b, c = (arena.alloc(n) for n in (1, ARENA_ALIGN + 1, 100))
        assert [s.offset for s in (a, b, c)] == [0, ARENA_ALIGN, 3 * ARENA_ALIGN]
        assert all(s.offset % ARENA_ALIGN == 0 for s in (a, b, c))
        arena.tensor(a, 1).fill_(1)
        arena.tensor(b, ARENA_ALIGN + 1).fill_(2)
        assert int(arena.tensor(a, 1)[0]) == 1  # b's bytes did not spill into a's span
        arena.free(b)  # a hole between a and c: the next small span fits there
        d = arena.alloc(ARENA_ALIGN)
        assert d.offset == ARENA_ALIGN
        for s in (c, a, d):  # the middle one last: it joins both neighbours
            arena.free(s)
        # Everything freed, in any order: one free span again, the whole arena.
        assert arena.free_bytes() == size and arena.alloc(size) == arena_mod.Span(0, size)
    finally:
        arena.close()


def test_a_full_arena_says_so_and_takes_spans_again_once_freed() -> None:
    arena = arena_mod.HoldArena(shm.MIN_BYTES)
    try:
        size = arena.segment.size
        half = arena.alloc(size // 2)
        rest = arena.alloc(size - size // 2)
        assert half and rest and arena.alloc(1) is None
        arena.free(half)
        assert arena.alloc(size // 2 + 1) is None  # no span that big: it goes to private memory
        assert arena.alloc(size // 2) == half
    finally:
        arena.close()


def test_the_arena_is_clipped_to_half_the_free_dev_shm(monkeypatch) -> None:
    class Tiny:
        f_bavail, f_frsize = 3 * shm.MIN_BYTES // 4096, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Tiny)
    arena = arena_mod.HoldArena.make(256 << 20)
    try:
        assert arena is not None and arena.segment.size == 3 * shm.MIN_BYTES // 2
    finally:
        arena.close()
    Tiny.f_bavail = shm.MIN_BYTES // 4096  # half of it is under MIN_BYTES: no arena at all
    assert arena_mod.HoldArena.make(256 << 20) is None


def test_a_consumer_reads_the_arena_read_only() -> None:
    arena = arena_mod.HoldArena(shm.MIN_BYTES)
    seen = shm.Segment.attach(arena.name, readonly=True)  # as a consumer's end maps it
    try:
        span = arena.alloc(8)
        arena.tensor(span, 8).copy_(torch.arange(8, dtype=torch.uint8))
        assert seen.tensor(8, span.offset).tolist() == list(range(8))
        # Mapped PROT_READ: a write (a stray one through the tensor would be SIGSEGV) is refused.
        with pytest.raises(TypeError, match="readonly"):
            seen._buf[0] = 1
        with pytest.raises(ValueError, match="outside"):
            seen.tensor(8, arena.segment.size - 4)
    finally:
        seen.close()
        arena.close()
