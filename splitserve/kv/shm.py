"""Shared-memory segments for the same-host KV paths (transport/shm.py, transport/arena.py).

A segment lives in /dev/shm under a name only we make; a peer that can open it and read back a
nonce written at its start shares our /dev/shm (same host and IPC namespace: two containers of
one pod, not two pods). Its pages are reserved when it is made, so a /dev/shm too small for it
refuses it then instead of killing whoever touches a page beyond its room with SIGBUS.

Leaks: the segment is created through `multiprocessing.shared_memory`, whose resource tracker
unlinks it if its creator dies without doing so (SIGKILL included). A peer attaches by opening
/dev/shm directly, so it never registers (and so never unlinks, nor warns about) a segment that
is not its own. When the tracker dies too (a whole process group SIGKILLed), the segment would
stay: so its creator holds an exclusive `flock` on it for its life, the kernel drops that lock
with the creator's last descriptor however it dies, and each process sweeps unlocked segments
before making its first (`sweep_orphans`). A lock rather than a pid in the name: two containers
of one pod share /dev/shm but not their pid namespaces. Linux only: elsewhere `available()` is
false and the pair channel serves.

Whose segment is it? A process tree started with $SPLITSERVE_KV_SHM_TAG (8 hex digits) names
every segment it makes `splitserve-kv-<tag><16 random hex>`: on a host where several splitserves
share /dev/shm, `leftover_segments(tag)` lists one's own (a test run's leak check, an operator
after a crash). Without it the 24 hex digits are all random; either way a peer attaches alike.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import mmap
import os
import re
import secrets
import sys
import time
import warnings
from multiprocessing import shared_memory

import torch

log = logging.getLogger(__name__)

PREFIX = "splitserve-kv-"
_NAME = re.compile(r"^splitserve-kv-[0-9a-f]{24}$")
TAG_ENV = "SPLITSERVE_KV_SHM_TAG"  # optional: the first 8 hex digits of our segments' names
_TAG = re.compile(r"^[0-9a-f]{8}$")
SHM_DIR = "/dev/shm"
NONCE_BYTES = 16
MIN_BYTES = 1 << 20  # the first segment; it grows (geometrically) with the largest pull


def available() -> bool:
    return sys.platform == "linux" and os.path.isdir(SHM_DIR)


ORPHAN_MIN_AGE_S = 60.0  # younger segments are left alone: their creator may not hold the lock yet


def leftover_segments(tag: str | None = None) -> list[str]:
    """Our segments present in /dev/shm now (for leak checks); with `tag`, only those made by
    processes that ran with $SPLITSERVE_KV_SHM_TAG = `tag` (module docstring)."""
    if tag is not None and not _TAG.match(tag):
        raise ValueError(f"a segment tag is 8 lowercase hex digits, got {tag!r}")
    start = PREFIX + (tag or "")
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(start)) if available() else []


def _new_name() -> str:
    """PREFIX, then $SPLITSERVE_KV_SHM_TAG if set, then random hex up to 24 digits."""
    tag = os.environ.get(TAG_ENV, "")
    if tag and not _TAG.match(tag):
        raise ValueError(f"${TAG_ENV} must be 8 lowercase hex digits, got {tag!r}")
    return PREFIX + tag + secrets.token_hex(12)[len(tag):]


def sweep_orphans(min_age_s: float = ORPHAN_MIN_AGE_S) -> list[str]:
    """Unlink our segments that no live process holds (their creator died with its resource
    tracker) and that were last changed over `min_age_s` ago; returns their names."""
    removed = []
    for name in leftover_segments():
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            if time.time() - os.fstat(fd).st_mtime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its creator is alive
            os.unlink(path)
            removed.append(name)
        except OSError as e:
            log.debug("orphan segment %s not swept: %s", name, e)
        finally:
            os.close(fd)  # drops our lock too
    if removed:
        log.warning("removed %d shared-memory KV segment(s) left by dead processes: %s",
                    len(removed), ", ".join(removed))
    return removed


@functools.cache
def _sweep_once() -> None:
    """Once per process, before its first segment: enough to keep dead processes' segments from
    piling up across restarts, without a scan of /dev/shm for every segment made."""
    sweep_orphans()


class Segment:
    """A mapped segment; `tensor(n)` is a uint8 view of its first n bytes."""

    def __init__(self, name: str, buf, owner: shared_memory.SharedMemory | None) -> None:
        self.name = name
        self._buf = buf  # an mmap (attached) or the SharedMemory's memoryview (created)
        self._owner = owner
        self.size = len(buf)
        with warnings.catch_warnings():
            # A read-only map (a producer's hold arena, seen by a consumer) makes a tensor
            # torch calls non-writable; we only ever read from it.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self._flat = torch.frombuffer(buf, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """A new segment of at least `nbytes`; OSError (ENOSPC) when /dev/shm has no room,
        ValueError when $SPLITSERVE_KV_SHM_TAG is not 8 hex digits.

        Its pages are reserved now: a tmpfs that is too small (a container's default /dev/shm
        is 64 MiB) would otherwise accept the size and kill whoever first touches a page
        beyond its room with SIGBUS."""
        _sweep_once()
        shm = shared_memory.SharedMemory(name=_new_name(), create=True,
                                         size=max(nbytes, MIN_BYTES))
        try:
            # Held until close() closes the descriptor, or the kernel does at our death:
            # while it is held, no sweep takes the segment (module docstring).
            fcntl.flock(shm._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(shm._fd, 0, shm.size)
        except OSError:
            shm.close()
            shm.unlink()
            raise
        return cls(shm.name, shm.buf, shm)

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> Segment:
        """Open the peer's segment `name`; OSError if it is not here (another host or IPC
        namespace) or not ours to open."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise OSError(f"not a splitserve KV segment name: {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY if readonly else os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ if readonly
                           else mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mm, None)

    def tensor(self, nbytes: int, offset: int = 0) -> torch.Tensor:
        """`nbytes` from `offset` (ValueError when they are not inside the segment)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"span {offset}+{nbytes} is outside segment {self.name} "
                             f"({self.size} bytes)")
        return self._flat[offset:offset + nbytes]

    def write_nonce(self) -> str:
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._buf[:NONCE_BYTES] = nonce
        return nonce.hex()

    def read_nonce(self) -> str:
        return bytes(self._buf[:NONCE_BYTES]).hex()

    def close(self) -> None:
        """Unmap; the owner also unlinks (the name goes at once, the memory with the last map)."""
        self._flat = None  # type: ignore[assignment]
        try:
            if self._owner is not None:
                try:
                    self._owner.close()
                finally:
                    self._owner.unlink()
            else:
                self._buf.close()
        except BufferError:
            # A view of it is still alive somewhere (an exception's traceback): the mapping
            # goes when that does; the name is already unlinked above.
            log.debug("segment %s still viewed at close", self.name)
        except FileNotFoundError:
            pass
