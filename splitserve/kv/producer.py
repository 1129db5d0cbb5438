"""Producer (prefill) side of a pull transfer, running in vLLM's worker process.

Lifecycle of one transfer here (states and their bookkeeping: transfers.py):
  hold(T, req, blocks)  the scheduler half finished request `req` with max_tokens=1, kept its
                        blocks and issued ticket T; the lease starts. In copy-out mode (the CPU
                        default) the blocks' bytes are copied out right here, into memory a
                        transport lends when one serves such copies best (`Kind.hold_space`),
                        and vLLM gets the blocks back with this very step; the copy is what the
                        lease holds.
  pull(T, ids)          a consumer asks over the side channel: T is claimed, the connection's
                        transport stages the bytes (vLLM may reuse the blocks from then on), we
                        reply, and the transport sends what follows the reply; when it lent the
                        consumer our copy to read where it lies, T ends once the consumer says
                        Landed. T ends SENT (or FAILED).
  release(T)            the router (Release RPC, through the engine: control.py) or a consumer
                        that needs nothing lets go early; T ends RELEASED.
  lease expiry          nobody pulled in time; T ends EXPIRED, and a late pull is refused
                        explicitly instead of reading blocks that may belong to someone else.
`take_finished()` hands vLLM the requests whose blocks it may free (finished_sending).

One thread per consumer connection serves its pulls in order; each connection owns its
transport's end (transport/), chosen in the handshake (handshake.py), so connections never
contend for a process group or a staging buffer. At most `max_connections` are served at once:
one more is told so and closed, costing no thread. A connection starts with the mutual
handshake: both sides prove the shared secret before the producer reveals anything about its
transports or its cache.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import torch

from splitserve import faults
from splitserve.kv import blocks
from splitserve.kv import messages as m
from splitserve.kv.board import BoardWriter
from splitserve.kv.handshake import answer
from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.spec import KVSpec
from splitserve.kv.stats import TransferStats
from splitserve.kv.ticket import TransferId
from splitserve.kv.transfers import Refused, TransferBook
from splitserve.kv.transport import Kind, Place, ProducerEnd, TransportError
from splitserve.kv.transport.choice import choose, producer_kinds
from splitserve.kv.wire import WireError, no_delay

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
        self.kinds: list[Kind] = []  # the transports this producer serves, best first
        self._slots = threading.BoundedSemaphore(settings.max_connections)
        self._count_lock = threading.Lock()
        self.book.on_dropped = lambda t: t.span.free() if t.span is not None else None
        self.connections = 0  # being served now (for tests and harnesses)
        self.accepted = 0  # ever accepted, turned away or not

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, kv_caches: dict[str, torch.Tensor], spec: KVSpec) -> None:
        s = self.settings
        self._kv, self._spec = kv_caches, spec
        if s.status_file:
            self.book.on_change = BoardWriter(s.status_file).publish
        place = Place(kv_caches, s.data_address, s.timeout_s)
        self.kinds = producer_kinds(s, place, self.copy_out)
        sock = socket.create_server((s.host, s.side_channel_port))
        self.side_port = sock.getsockname()[1]  # the real port when asked for port 0
        sock.settimeout(0.5)  # lets the accept loop notice shutdown (and reap leases)
        self._sock = sock
        threading.Thread(target=self._accept_loop, name="kv-producer-accept", daemon=True).start()
        log.info("KV producer %s listening on %s:%d (%s)", self.engine_id, s.host,
                 self.side_port, ", ".join(k.name for k in self.kinds))

    def shutdown(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        for kind in self.kinds:
            kind.close()

    # -- called from the connector's worker half (engine thread) -----------------------------
    def hold(self, tid: TransferId, req_id: str, block_ids: list[int]) -> None:
        snapshot = held = None
        if self.copy_out:
            # Copy the blocks out now and give them back to vLLM with this very step: an engine
            # holding finished requests' blocks keeps stepping (busy) until they are freed, which
            # on a CPU host steals the cores its own server and its neighbours need. Into memory
            # a transport lends when one has room (a consumer may read the copy there).
            n = len(block_ids)
            nbytes = blocks.staging_bytes(self._kv, n)
            held = next((h for k in self.kinds if (h := k.hold_space(nbytes)) is not None), None)
            snapshot = held.tensor if held is not None else torch.empty(
                nbytes, dtype=torch.uint8, device=next(iter(self._kv.values())).device)
            blocks.gather(self._kv, block_ids, blocks.staging_view(snapshot, self._kv, n))
        self.book.hold(tid, req_id, block_ids, snapshot, held)

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
            m.send(conn, m.Refusal(f"KV producer {self.engine_id} is serving its limit of {n} "
                                   f"connection(s)"))
        except WireError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket, addr) -> None:
        end: ProducerEnd | None = None
        timeout_s = self.settings.timeout_s
        conn.settimeout(timeout_s)
        try:
            assert self._spec is not None
            end = answer(conn, engine_id=self.engine_id, spec=self._spec,
                         secret=self.settings.secret, choose=lambda o: choose(self.kinds, o))
            if end is None:
                return
            conn.settimeout(None)  # idle connections are fine; each request has its own bounds
            while not self._stop.is_set():
                msg = m.recv(conn, m.Pull, m.Release)
                conn.settimeout(timeout_s)
                if isinstance(msg, m.Pull):
                    self._serve_pull(conn, end, msg)
                else:
                    m.send(conn, m.Released(self.release(TransferId(msg.transfer_id))))
                conn.settimeout(None)
        except (WireError, TransportError) as e:
            log.info("KV consumer %s disconnected: %s", addr, e)
        finally:
            if end is not None:
                end.close()
            conn.close()
            with self._count_lock:
                self.connections -= 1
            self._slots.release()

    def _serve_pull(self, conn: socket.socket, end: ProducerEnd, pull: m.Pull) -> None:
        tid, want = TransferId(pull.transfer_id), pull.block_ids
        try:
            # Half the transfer timeout at most: the consumer must hear "unknown" before it
            # gives up on its own.
            t = self.book.claim(tid, want, min(REGISTER_WAIT_S, self.settings.timeout_s / 2))
        except Refused as e:
            m.send(conn, m.Refusal(str(e)))
            return
        t0 = time.perf_counter()
        ok = False
        nbytes = blocks.staging_bytes(self._kv, len(want))
        try:
            staged = end.stage(t, want, pull.move)
            self.book.gathered(t)  # copied (or ours): vLLM may reuse the blocks from now on
            # A test's pause, the pull claimed and no byte delivered: it kills us here.
            faults.Faults.stall(self._faults.stall_before_send_s)
            m.send(conn, m.Pulled(nbytes, staged.reply))
            staged.send()
            if staged.landed:  # the consumer reads our copy where it lies: keep it till then
                landed = m.recv(conn, m.Landed)
                if landed.transfer_id != t.transfer_id:
                    raise TransportError(f"consumer confirmed transfer {landed.transfer_id}, "
                                         f"not {t.transfer_id}")
            ok = True
        except TransportError:
            self.stats.record_failure()
            raise
        finally:
            self.book.finish(t, ok)
        self.stats.record_transfer(nbytes, time.perf_counter() - t0, staged.path)

    # -- status (the board, harnesses) and release (the router's, via control.py) -------------
    def status(self) -> dict[str, int]:
        return self.book.status()

    def release(self, tid: TransferId) -> str:
        """The transfer's state before the release, or "unknown" (then remembered)."""
        before = self.book.release(tid)
        return before.label if before is not None else "unknown"

