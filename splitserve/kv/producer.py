"""Producer (prefill) side of a pull transfer, running in vLLM's worker process.

Lifecycle of one transfer here (states and their bookkeeping: transfers.py):
  hold(T, req, blocks)  the scheduler half finished request `req` with max_tokens=1, kept its
                        blocks and issued ticket T; the lease starts. In copy-out mode (the CPU
                        default) the blocks' bytes are copied out right here and vLLM gets the
                        blocks back with this very step; the copy is what the lease holds.
  pull(T, ids)          a consumer asks over the side channel: T is claimed, the blocks are
                        gathered into the pair's staging buffer (vLLM may reuse them from then on)
                        and the bytes go over the pair channel; T ends SENT (or FAILED). A
                        consumer on this host reads a copy held in the shared hold arena where
                        it lies instead, and T ends once it says it has read it (shm.py).
  release(T)            the router (Release RPC, through the engine: control.py) or a consumer
                        that needs nothing lets go early; T ends RELEASED.
  lease expiry          nobody pulled in time; T ends EXPIRED, and a late pull is refused
                        explicitly instead of reading blocks that may belong to someone else.
`take_finished()` hands vLLM the requests whose blocks it may free (finished_sending).

One thread per consumer connection serves its pulls in order; each connection owns one pair
channel (a 2-rank process group), or, when the consumer shares this host's memory, its consumer's
shared-memory segment (shm.py), so pairs never contend for a group or a staging buffer. At
most `max_connections` are served at once: one more is told so and closed, costing no thread.
A connection starts with the mutual handshake: both sides prove the shared secret before the
producer reveals its rendezvous store or anything about its cache (`_handshake`).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time

import torch

from splitserve import faults
from splitserve.kv import blocks
from splitserve.kv.board import BoardWriter
from splitserve.kv.link import Link
from splitserve.kv.pair_channel import PRODUCER_RANK, PairChannel, TransferError, host_store
from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.shm import HoldArena, ProducerAttachment
from splitserve.kv.spec import KVSpec
from splitserve.kv.stats import TransferStats
from splitserve.kv.ticket import TransferId
from splitserve.kv.transfers import Refused, Transfer, TransferBook
from splitserve.kv.wire import (
    CONSUMER,
    PRODUCER,
    WireError,
    auth_proof,
    check_proof,
    no_delay,
    recv_msg,
    send_msg,
)

log = logging.getLogger(__name__)

# How long a pull waits for its transfer to be registered: the consumer can learn the ticket
# (via the router) before this engine's next step has told the worker about it.
REGISTER_WAIT_S = 5.0


class Producer:
    def __init__(self, engine_id: str, settings: ConnectorSettings, stats: TransferStats,
                 copy_out: bool = False) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.stats = stats
        self._faults = faults.for_host(settings.host)
        self.copy_out = copy_out
        self.book = TransferBook(settings.lease_s)
        self.book.on_expired = lambda t: stats.record_lease_expired()
        self.side_port = settings.side_channel_port
        self._kv: dict[str, torch.Tensor] = {}
        self._spec: KVSpec | None = None
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._store = None
        self._slots = threading.BoundedSemaphore(settings.max_connections)
        self._count_lock = threading.Lock()
        # Copy-out holds go here once a consumer on this host has connected (shm.HoldArena).
        self.arena: HoldArena | None = None
        self._arena_lock = threading.Lock()
        self._arena_tried = False
        self.book.on_dropped = self._drop_copy
        self.connections = 0  # being served now (for tests and harnesses)
        self.accepted = 0  # ever accepted, turned away or not

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, kv_caches: dict[str, torch.Tensor], spec: KVSpec) -> None:
        s = self.settings
        self._kv, self._spec = kv_caches, spec
        if s.status_file:
            self.book.on_change = BoardWriter(s.status_file).publish
        self._store = host_store(s.host, 0, s.timeout_s)
        sock = socket.create_server((s.host, s.side_channel_port))
        self.side_port = sock.getsockname()[1]  # the real port when asked for port 0
        sock.settimeout(0.5)  # lets the accept loop notice shutdown (and reap leases)
        self._sock = sock
        threading.Thread(target=self._accept_loop, name="kv-producer-accept", daemon=True).start()
        log.info("KV producer %s listening on %s:%d (store port %d)", self.engine_id, s.host,
                 self.side_port, self._store.port)

    def shutdown(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        arena, self.arena = self.arena, None  # later holds take private memory
        if arena is not None:
            arena.close()  # unlinks the name; consumers' maps stay valid until they unmap

    # -- called from the connector's worker half (engine thread) -----------------------------
    def hold(self, tid: TransferId, req_id: str, block_ids: list[int]) -> None:
        snapshot = span = None
        if self.copy_out:
            # Copy the blocks out now and give them back to vLLM with this very step: an engine
            # holding finished requests' blocks keeps stepping (busy) until they are freed, which
            # on a CPU host steals the cores its own server and its neighbours need. Into the
            # shared arena when there is one with room: a consumer on this host reads it there.
            n = len(block_ids)
            nbytes = blocks.staging_bytes(self._kv, n)
            arena = self.arena
            span = arena.alloc(nbytes) if arena is not None else None
            if span is not None:
                snapshot = arena.tensor(span, nbytes)
            else:
                snapshot = torch.empty(nbytes, dtype=torch.uint8,
                                       device=next(iter(self._kv.values())).device)
            blocks.gather(self._kv, block_ids, blocks.staging_view(snapshot, self._kv, n))
        self.book.hold(tid, req_id, block_ids, snapshot, span)

    def _drop_copy(self, t: Transfer) -> None:
        if t.span is not None and self.arena is not None:
            self.arena.free(t.span)

    def _open_arena(self) -> None:
        """Once, when the first consumer on this host connects: copy-out holds from then on
        land where it can read them."""
        with self._arena_lock:
            if self._arena_tried or not self.copy_out or not self.settings.hold_arena_mib:
                return
            self._arena_tried = True
            self.arena = HoldArena.make(self.settings.hold_arena_mib << 20)
            if self.arena is not None:
                log.info("KV hold arena %s: %d MiB", self.arena.name,
                         self.arena.segment.size >> 20)

    def take_finished(self) -> set[str]:
        return self.book.take_finished()

    # -- side channel ------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
                no_delay(conn)
            except TimeoutError:
                self.book.reap()
                continue
            except OSError:
                return  # socket closed by shutdown()
            self.accepted += 1  # only this thread writes it
            if not self._slots.acquire(blocking=False):
                self._turn_away(conn, addr)
                continue
            with self._count_lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name=f"kv-producer-{addr[0]}:{addr[1]}").start()

    def _turn_away(self, conn: socket.socket, addr) -> None:
        n = self.settings.max_connections
        log.warning("refusing KV connection from %s: %d connection(s) already served", addr, n)
        try:
            conn.settimeout(0.1)  # a few bytes into a fresh socket's buffer: never blocks long
            send_msg(conn, {"ok": False, "error": f"KV producer {self.engine_id} is serving "
                                                  f"its limit of {n} connection(s)"})
        except WireError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket, addr) -> None:
        link: Link[ProducerAttachment] | None = None
        timeout_s = self.settings.timeout_s
        conn.settimeout(timeout_s)
        try:
            link = self._handshake(conn)
            if link is None:
                return
            conn.settimeout(None)  # idle connections are fine; each request has its own bounds
            while not self._stop.is_set():
                msg = recv_msg(conn)
                conn.settimeout(timeout_s)
                op = msg.get("op")
                if op == "pull":
                    self._serve_pull(conn, link, msg)
                elif op == "release":
                    state = self.release(TransferId(str(msg.get("transfer_id"))))
                    send_msg(conn, {"ok": True, "state": state})
                else:
                    send_msg(conn, {"ok": False, "error": f"unknown op {op!r}"})
                conn.settimeout(None)
        except (WireError, TransferError) as e:
            log.info("KV consumer %s disconnected: %s", addr, e)
        finally:
            if link is not None:
                link.close()
            conn.close()
            with self._count_lock:
                self.connections -= 1
            self._slots.release()

    def _handshake(self, conn: socket.socket) -> Link[ProducerAttachment] | None:
        """challenge → hello (the consumer's proof and challenge) → ok (ours) or refusal.

        The consumer may offer its shared-memory segment; we take it if we can open it and
        read its nonce (shm.py), and then build no pair channel."""
        assert self._spec is not None and self._store is not None
        s = self.settings
        challenge = secrets.token_hex(16)
        send_msg(conn, {"op": "challenge", "challenge": challenge, "engine_id": self.engine_id})
        hello = recv_msg(conn)
        theirs, pair_key = str(hello.get("challenge", "")), str(hello.get("pair_key", ""))
        error = None
        if s.secret and not check_proof(s.secret, CONSUMER, challenge, theirs, pair_key,
                                        hello.get("proof")):
            error = "authentication failed: wrong or missing shared secret"
        elif not pair_key or len(theirs) < 32:
            error = "malformed hello: a pair key and a challenge of 16+ bytes are required"
        elif hello.get("expect_engine_id") not in (None, self.engine_id):
            error = (f"engine id mismatch: consumer expected {hello.get('expect_engine_id')!r}, "
                     f"this producer is {self.engine_id!r}")
        else:
            try:
                peer = KVSpec.from_dict(hello.get("spec") or {})
            except (TypeError, ValueError) as e:
                error = f"malformed KV spec: {e}"
            else:
                diffs = self._spec.differences(peer)
                if diffs:
                    error = "incompatible KV cache: " + "; ".join(diffs)
        if error:
            log.warning("refusing KV consumer %s: %s", hello.get("engine_id"), error)
            send_msg(conn, {"ok": False, "error": error})
            return None
        device = next(iter(self._kv.values())).device
        shm = (ProducerAttachment.accept(hello.get("shm"))
               if "shm" in hello and s.shares_memory(device.type) else None)
        if shm is not None:
            self._open_arena()  # before the reply: the consumer's first pull may follow at once
        port = self._store.port
        bound = f"{port}/shm" if shm else str(port)  # the proof covers the path we chose
        send_msg(conn, {"ok": True, "store_port": port, "shm": shm is not None,
                        "proof": auth_proof(s.secret, PRODUCER, challenge, theirs, bound)
                        if s.secret else ""})
        if shm is not None:
            return Link(None, shm)
        return Link(PairChannel(self._store, pair_key, PRODUCER_RANK, device, s.timeout_s,
                                 s.host), None)

    def _serve_pull(self, conn: socket.socket, link: Link[ProducerAttachment], msg: dict) -> None:
        tid = TransferId(str(msg.get("transfer_id")))
        want = [int(b) for b in msg.get("block_ids", [])]
        try:
            # Half the transfer timeout at most: the consumer must hear "unknown" before it
            # gives up on its own.
            t = self.book.claim(tid, want, min(REGISTER_WAIT_S, self.settings.timeout_s / 2))
        except Refused as e:
            send_msg(conn, {"ok": False, "error": str(e)})
            return
        t0 = time.perf_counter()
        ok = False
        nbytes = blocks.staging_bytes(self._kv, len(want))
        from_arena = link.shm is not None and t.span is not None and bool(msg.get("arena"))
        try:
            if from_arena:
                self._serve_from_arena(conn, t, want, nbytes)
            elif link.shm is not None:
                try:
                    into = link.shm.buffer(msg.get("shm"), nbytes)
                except (OSError, ValueError) as e:
                    raise TransferError(f"consumer's shared memory: {e}") from e
                self._gather(into, t.block_ids, want, t.snapshot)
                self.book.gathered(t)
                self._stall()
                send_msg(conn, {"ok": True, "nbytes": nbytes})  # the bytes are in place
            else:
                assert link.chan is not None
                raw = self._gather(None if t.snapshot is not None and want == t.block_ids
                                   else link.chan.staging(nbytes), t.block_ids, want,
                                   t.snapshot)
                self.book.gathered(t)  # copied (or ours): vLLM may reuse the blocks from now on
                send_msg(conn, {"ok": True, "nbytes": nbytes})
                self._stall()
                link.chan.send(raw, int(msg["tag"]))
            ok = True
        except TransferError:
            self.stats.record_failure()
            raise
        finally:
            self.book.finish(t, ok)
        self.stats.record_transfer(nbytes, time.perf_counter() - t0, link.shm is not None,
                                   arena=from_arena)

    def _serve_from_arena(self, conn: socket.socket, t: Transfer, want: list[int],
                          nbytes: int) -> None:
        """The consumer reads the held copy where it lies: tell it where, then keep the span
        until it says it has read it (the book frees the span when the transfer ends)."""
        self._stall()
        arena = self.arena
        if arena is None:
            raise TransferError("KV producer is shutting down")
        where = {b: i for i, b in enumerate(t.block_ids)}
        positions = [where[b] for b in want]
        send_msg(conn, {"ok": True, "nbytes": nbytes, "arena": {
            "name": arena.name, "offset": t.span.offset, "blocks": len(t.block_ids),
            "positions": None if positions == list(range(len(t.block_ids))) else positions}})
        done = recv_msg(conn)
        if done.get("op") != "read" or done.get("transfer_id") != t.transfer_id:
            raise TransferError(f"consumer did not confirm reading transfer {t.transfer_id}: "
                                f"{done}")

    def _stall(self) -> None:
        """A test's pause mid-transfer, the pull claimed and no byte delivered: it kills us
        there (faults.py)."""
        faults.Faults.stall(self._faults.stall_before_send_s)

    def _gather(self, raw: torch.Tensor | None, held: list[int], want: list[int],
                snapshot: torch.Tensor | None) -> torch.Tensor:
        """`want` (a subset of `held`, in the consumer's order) as one contiguous buffer: `raw`
        (staging bytes), or, when None, the snapshot itself (all of it, in order)."""
        if snapshot is not None and want == held:
            if raw is None:
                return snapshot  # the common case: everything, in order, already contiguous
            raw.copy_(snapshot[:raw.numel()])
            return raw
        assert raw is not None
        out = blocks.staging_view(raw, self._kv, len(want))
        if snapshot is None:
            blocks.gather(self._kv, want, out)
        else:
            where = {b: i for i, b in enumerate(held)}
            snap = blocks.staging_view(snapshot, self._kv, len(held))
            pos = torch.tensor([where[b] for b in want], dtype=torch.long, device=snap.device)
            torch.index_select(snap, 1, pos, out=out)
        return raw

    # -- status (the board, harnesses) and release (the router's, via control.py) -------------
    def status(self) -> dict[str, int]:
        return self.book.status()

    def release(self, tid: TransferId) -> str:
        """The transfer's state before the release, or "unknown" (then remembered)."""
        before = self.book.release(tid)
        return before.label if before is not None else "unknown"

