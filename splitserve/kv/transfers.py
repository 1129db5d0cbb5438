"""The producer's book of transfers: which KV it holds, for whom, and what became of it.

States (ordered; a transfer only moves forward, and every state from SENT on is final):

    HELD ──pull──► CLAIMED ──► SENT
      │                   └──► FAILED     the send broke (consumer gone); the KV is gone too
      ├──release──► RELEASED              the router or consumer will not pull it
      └──lease──► EXPIRED                 nobody pulled or released it in time

`_move` is the one place a transfer changes state; `_end` is the one place its KV is let go:
vLLM's blocks are handed back (reported by `take_finished` as finished_sending, unless they were
handed back earlier: right at the hold in copy-out mode, or once a pull has gathered them) and
the copy, if any, is dropped. Ended transfers are remembered for a while so that a late pull or
release gets a precise answer, and a release that arrives before its hold (the router gave up
while the prefill was finishing) is remembered too, so the hold is freed the moment it begins.

Thread-safe: the engine thread holds and collects, side-channel threads claim and release.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitserve.kv.ticket import TransferId

log = logging.getLogger(__name__)

_REMEMBER_ENDED = 4096  # ended transfers whose fate a late pull or release can still learn


class TransferState(enum.IntEnum):
    HELD = 0  # lease running; the KV is in vLLM's blocks or in a copy of them
    CLAIMED = 1  # a pull is gathering / sending it
    SENT = 2
    RELEASED = 3
    EXPIRED = 4
    FAILED = 5

    @property
    def live(self) -> bool:
        return self < TransferState.SENT

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class Transfer:
    transfer_id: TransferId
    req_id: str  # vLLM's id of the finished prefill request: what finished_sending names
    block_ids: list[int]
    expires_at: float  # time.monotonic() of this process
    state: TransferState = TransferState.HELD
    # Copy-out mode: the blocks' bytes, taken when the hold began; pulls are served from here.
    snapshot: Any = None
    span: Any = None  # where the snapshot lies in the producer's shared hold arena, if there
    blocks_returned: bool = False  # vLLM has been told (or will be) it may reuse the blocks


class Refused(Exception):
    """A pull or claim the book cannot grant; the message says why, for the consumer."""


class TransferBook:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._cond = threading.Condition()
        self._live: dict[TransferId, Transfer] = {}
        self._ended: collections.OrderedDict[TransferId, TransferState] = (
            collections.OrderedDict())
        self._ended_counts = {s: 0 for s in TransferState if not s.live}
        self._finished: set[str] = set()  # vLLM request ids whose blocks may be freed
        self.on_expired: Callable[[Transfer], None] = lambda t: None  # stats hook
        # Called (under the lock) as a transfer's snapshot is dropped: its arena span is free.
        self.on_dropped: Callable[[Transfer], None] = lambda t: None
        # Called (under the lock) with `status()` after every change: the producer's board.
        self.on_change: Callable[[dict[str, int]], None] = lambda counts: None

    # -- the engine thread ---------------------------------------------------------------------
    def hold(self, tid: TransferId, req_id: str, block_ids: list[int], snapshot: Any = None,
             span: Any = None) -> None:
        """Start the lease on `tid`. With a snapshot, vLLM gets its blocks back at once."""
        t = Transfer(tid, req_id, list(block_ids), time.monotonic() + self.lease_s,
                     snapshot=snapshot, span=span)
        with self._cond:
            if tid in self._live or tid in self._ended:
                # Released before its hold began (or an id used twice): nobody will pull it.
                log.info("transfer %s: %s; freed at once", tid, "id already in use"
                         if tid in self._live else "released before its hold began")
                self._finished.add(req_id)
                self.on_dropped(t)
                self._ended_counts[TransferState.RELEASED] += tid not in self._live
                self._changed()
                return
            if snapshot is not None:
                self._return_blocks(t)
            self._live[tid] = t
            self._changed()

    def take_finished(self) -> set[str]:
        """vLLM request ids whose blocks may be freed now (finished_sending)."""
        with self._cond:
            self.reap()
            done, self._finished = self._finished, set()
        return done

    # -- side-channel threads ------------------------------------------------------------------
    def claim(self, tid: TransferId, block_ids: list[int], wait_s: float) -> Transfer:
        """HELD → CLAIMED for a pull of `block_ids`, waiting up to `wait_s` for the hold to be
        registered (a consumer can learn the ticket before this engine's next step)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            self.reap()
            while tid not in self._live:
                if tid in self._ended:
                    raise Refused(f"transfer {tid}: {_ENDED_WHY[self._ended[tid]]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Refused(f"transfer {tid}: unknown to this producer (never held)")
                self._cond.wait(left)
            t = self._live[tid]
            if t.state is not TransferState.HELD:
                raise Refused(f"transfer {tid}: already being sent to another consumer")
            if not set(block_ids) <= set(t.block_ids):
                self._end(t, TransferState.RELEASED)
                raise Refused(f"transfer {tid}: requested blocks are not among the held ones")
            self._move(t, TransferState.CLAIMED)
            self._changed()
            return t

    def gathered(self, t: Transfer) -> None:
        """The pull copied the blocks into its staging buffer: vLLM may reuse them now."""
        with self._cond:
            self._return_blocks(t)

    def finish(self, t: Transfer, ok: bool) -> None:
        with self._cond:
            self._end(t, TransferState.SENT if ok else TransferState.FAILED)

    def release(self, tid: TransferId) -> TransferState | None:
        """Let go of `tid`; returns its state before (None: unknown, remembered as released).
        A transfer already being sent cannot be stopped; it ends on its own."""
        with self._cond:
            t = self._live.get(tid)
            if t is None:
                before = self._ended.get(tid)
                if before is None:
                    self._remember(tid, TransferState.RELEASED)
                return before
            before = t.state
            if before is TransferState.HELD:
                self._end(t, TransferState.RELEASED)
            return before

    # -- any thread ----------------------------------------------------------------------------
    def reap(self) -> None:
        """Expire leases. Runs on engine steps, on every claim, and from the side channel's
        accept loop: an idle engine takes no steps, and a copy must still be freed on time."""
        now = time.monotonic()
        with self._cond:
            for t in [t for t in self._live.values()
                      if t.state is TransferState.HELD and t.expires_at <= now]:
                self._end(t, TransferState.EXPIRED)
                self.on_expired(t)
                log.warning("KV lease expired for transfer %s after %.1f s: freed unsent",
                            t.transfer_id, self.lease_s)

    def status(self) -> dict[str, int]:
        """Live transfers now, ended ones since start, and the blocks the live ones hold."""
        with self._cond:
            self.reap()
            return self._counts()

    def _counts(self) -> dict[str, int]:
        counts = {s.label: 0 for s in TransferState}
        for t in self._live.values():
            counts[t.state.label] += 1
        for s, n in self._ended_counts.items():
            counts[s.label] = n
        counts["held_blocks"] = sum(len(t.block_ids) for t in self._live.values())
        return counts

    def _changed(self) -> None:
        self.on_change(self._counts())
        self._cond.notify_all()

    # -- the two places state changes (caller holds the lock) ----------------------------------
    def _move(self, t: Transfer, new: TransferState) -> None:
        assert new > t.state, f"transfer {t.transfer_id}: {t.state.name} -> {new.name}"
        t.state = new

    def _end(self, t: Transfer, final: TransferState) -> None:
        assert not final.live
        self._move(t, final)
        self._return_blocks(t)
        if t.snapshot is not None:
            self.on_dropped(t)
        t.snapshot = t.span = None
        del self._live[t.transfer_id]
        self._ended_counts[final] += 1
        self._remember(t.transfer_id, final)
        self._changed()

    def _return_blocks(self, t: Transfer) -> None:
        if not t.blocks_returned:
            t.blocks_returned = True
            self._finished.add(t.req_id)

    def _remember(self, tid: TransferId, final: TransferState) -> None:
        self._ended[tid] = final
        self._ended.move_to_end(tid)
        while len(self._ended) > _REMEMBER_ENDED:
            self._ended.popitem(last=False)


_ENDED_WHY = {
    TransferState.SENT: "already sent",
    TransferState.RELEASED: "released; nothing is held",
    TransferState.EXPIRED: "lease expired before the pull; the KV was freed",
    TransferState.FAILED: "an earlier send of it failed; the KV was freed",
}
