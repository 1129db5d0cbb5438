"""Consumer (decode) side of a pull transfer, running in vLLM's worker process.

Lifecycle of one load here:
  submit(job)      the scheduler half parked request R in WAITING_FOR_REMOTE_KVS with fresh
                   local blocks; a pool thread takes the job so the engine step never blocks.
  pull             over the producer's side channel: Pull "blocks X of transfer T"; the bytes
                   arrive by the connection's transport (transport/) as a staging view and are
                   scattered into R's local blocks (nobody else can touch those blocks while R
                   is parked); a transport that lends us the producer's own copy is told Landed.
  take_results()   R is reported finished (and failed, with its blocks, if the pull failed) on
                   the next engine step; vLLM then decodes R or applies the failure policy.
Every job ends in take_results(), success or not: a parked request whose id never comes back
would hold its blocks forever. load_now(job) is the in-step form (the default, `load="sync"`):
the same pull on the engine's thread, before the forward pass that reads the blocks.
load_layered(job) (`load="layered"`) runs it on a helper thread beside that forward pass, which
waits for each layer's blocks before it reads them (layered.py).

One connection per producer address, made on first use (handshake.py: the transport is chosen
there) and reused; a failed connection is dropped and the next job to that producer handshakes
afresh, and a transport that could not take a pull (Unusable) is not offered to that producer
again. Each connection has its own lock, taken for the connect as well as for each transfer:
jobs to one producer run in order, and a slow or dead producer (a connect or handshake waiting
out its timeout) never delays jobs to any other. A producer that let a load wait out its timeout
and lost the link (hung, unreachable) is marked down for `timeout_s`: loads from it fail at once
(and vLLM recomputes or fails them by policy) instead of each waiting out a timeout, which
in-step would stall the whole decode batch once per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from splitserve import faults
from splitserve.kv import blocks
from splitserve.kv import messages as m
from splitserve.kv.handshake import Connection, IncompatiblePeer, connect
from splitserve.kv.layered import LayeredScatter, leave_engine_cores
from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.spec import KVSpec
from splitserve.kv.stats import TransferStats
from splitserve.kv.ticket import KVTicket
from splitserve.kv.transport import Place, TransportError, Unusable
from splitserve.kv.transport.choice import consumer_offers
from splitserve.kv.wire import WireError

log = logging.getLogger(__name__)

# How a pull's bytes go from the staging buffer into the local blocks: blocks.scatter, or a
# LayeredScatter that lets the forward pass start before it ends (layered.py).
Scatter = Callable[[torch.Tensor, dict[str, torch.Tensor], list[int]], None]


@dataclass(frozen=True, slots=True)
class PullJob:
    req_id: str  # this engine's internal request id (reported back to vLLM)
    ticket: KVTicket
    local_block_ids: list[int]
    remote_block_ids: list[int]  # same length, position for position; a subset of the ticket's
    corrupt: bool = False  # fault injection (tests): flip the received bytes
    sync: bool = False  # loaded inside the engine step (`load_now`), not by the pool
    # In-step loads: the local block that this step also writes (the first new token's slot
    # in the prompt's last, partial block), when it is one of ours; layered.py.
    tail_block: int | None = None


@dataclass(frozen=True, slots=True)
class LoadResult:
    req_id: str
    ok: bool
    block_ids: list[int]  # the local blocks, invalid when not ok
    error: str | None = None


class _Peer:
    """One producer address. `lock` serialises the connect and each transfer on it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.lock = threading.Lock()
        self.conn: Connection | None = None
        self.unusable: set[str] = set()  # transports not to offer it again (they had no room)
        # Loads from this producer fail at once until then (monotonic time): a load from it
        # timed out and lost the link. An in-step load makes the whole decode batch wait, so
        # a hung producer must cost one timeout, not one per request queued with its tickets.
        self.down_until = 0.0

    def drop(self) -> None:  # caller holds `lock`
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _check_up(peer: _Peer) -> None:
    left = peer.down_until - time.monotonic()
    if left > 0:
        raise TransportError(f"KV producer at {peer.host}:{peer.port} is marked down for "
                            f"{left:.1f} s more (a load from it timed out)")


class Consumer:
    def __init__(self, engine_id: str, settings: ConnectorSettings, stats: TransferStats,
                 max_workers: int = 4) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.stats = stats
        self._faults = faults.for_host(settings.host)
        self._kv: dict[str, torch.Tensor] = {}
        self._place: Place | None = None
        self._spec: KVSpec | None = None
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-pull")
        # Layered in-step loads (one per step at most), beside the engine's forward pass.
        self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-layered",
                                          initializer=leave_engine_cores)
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._peers_lock = threading.Lock()  # guards the dict only, never held across I/O
        self._results: list[LoadResult] = []
        self._results_lock = threading.Lock()

    def start(self, kv_caches: dict[str, torch.Tensor], spec: KVSpec) -> None:
        self._kv, self._spec = kv_caches, spec
        self._place = Place(kv_caches, self.settings.data_address, self.settings.timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._beside.shutdown(wait=False, cancel_futures=True)
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            if peer.conn is not None:
                peer.conn.close()

    # -- called from the connector's worker half (engine thread) -----------------------------
    def submit(self, job: PullJob) -> None:
        self._pool.submit(self._run, job)

    def load_now(self, job: PullJob) -> bool:
        """Pull `job` on the calling thread (the engine's, before a forward pass that reads the
        blocks); False when it failed, and the caller reports the blocks as not loaded."""
        return self._load(job) is None

    def load_layered(self, job: PullJob) -> tuple[LayeredScatter, Future[str | None]]:
        """Start pulling `job` beside the engine's thread, scattering it layer by layer (the
        forward's `wait_layer`); returns once the forward pass may start (`ready`). The future's
        result is the load's error, or None: join it after the forward, before vLLM reads the
        step's output."""
        layered = LayeredScatter(len(self._kv), job.tail_block, self._faults)

        def run() -> str | None:
            try:
                return self._load(job, layered)
            finally:
                layered.finish()

        done = self._beside.submit(run)
        layered.ready.wait()
        return layered, done

    def release(self, ticket: KVTicket) -> None:
        """Tell the producer we will not pull (best effort; its lease is the net)."""
        self._pool.submit(self._release, ticket)

    def take_results(self) -> list[LoadResult]:
        with self._results_lock:
            out, self._results = self._results, []
        return out

    # -- pool threads ------------------------------------------------------------------------
    def _run(self, job: PullJob) -> None:
        error = self._load(job)  # any failure must still come back as a result
        self._finish(LoadResult(job.req_id, error is None, job.local_block_ids, error))

    def _load(self, job: PullJob, scatter: Scatter = blocks.scatter) -> str | None:
        """One pull, counted in the stats; the error, or None when the blocks are loaded."""
        t0 = time.perf_counter()
        tk = job.ticket
        try:
            nbytes, path = self._pull(job, scatter)
        except Exception as e:
            self.stats.record_failure()
            log.warning("KV load for %s (transfer %s from %s:%d) failed: %s", job.req_id,
                        tk.transfer_id, tk.host, tk.port, e)
            return str(e)
        self.stats.record_transfer(nbytes, time.perf_counter() - t0, path)
        return None

    def _finish(self, result: LoadResult) -> None:
        with self._results_lock:
            self._results.append(result)

    def _pull(self, job: PullJob, scatter: Scatter) -> tuple[int, str]:
        """The bytes moved, and the path they took (the transport's label, for the stats)."""
        assert len(job.local_block_ids) == len(job.remote_block_ids)
        peer = self._peer(job.ticket)
        with peer.lock:
            _check_up(peer)  # under the lock: loads queued behind the one that timed out
            t0 = time.monotonic()
            try:
                return self._pull_locked(peer, job, scatter)
            except Exception:
                # Marked down only when the load waited out its timeout and no link is left (a
                # hung or unreachable producer): the case that stalls an in-step batch. A quick
                # failure (connection refused, a producer at its connection limit) costs the
                # next load nothing, and a refusal over a live link (an expired lease) says
                # nothing of it. 0.9: the socket's own clock against ours.
                if (peer.conn is None
                        and time.monotonic() - t0 >= 0.9 * self.settings.timeout_s):
                    peer.down_until = time.monotonic() + self.settings.timeout_s
                raise

    def _pull_locked(self, peer: _Peer, job: PullJob, scatter: Scatter) -> tuple[int, str]:
        assert self._spec is not None
        tk = job.ticket
        conn = self._connected(peer, tk)
        want = blocks.staging_bytes(self._kv, len(job.local_block_ids))
        try:
            move = conn.end.request(want)
        except Unusable as e:
            log.warning("%s: transfers from %s:%d go without %r from now on", e, peer.host,
                        peer.port, conn.offer)
            peer.unusable.add(conn.offer)
            peer.drop()
            conn = self._connected(peer, tk)
            move = conn.end.request(want)
        if tk.spec_fingerprint and tk.spec_fingerprint != self._spec.fingerprint():
            # The handshake passed, so this producer's cache matches ours: the ticket was
            # issued by another incarnation at this address. Its block ids mean nothing here.
            raise IncompatiblePeer(f"ticket {tk.transfer_id} names a KV cache with spec "
                                   f"{tk.spec_fingerprint}, ours is {self._spec.fingerprint()}")
        try:
            m.send(conn.sock, m.Pull(tk.transfer_id, job.remote_block_ids, move))
            reply = m.recv(conn.sock, m.Pulled, m.Refusal)
            if isinstance(reply, m.Refusal):
                # The producer refused this transfer; the connection itself is fine.
                raise TransportError(f"producer refused: {reply.error}")
            if reply.nbytes != want:
                peer.drop()  # out of step with the producer: start afresh
                raise TransportError(f"producer announced {reply.nbytes} bytes for "
                                     f"{len(job.local_block_ids)} blocks")
            incoming = conn.end.receive(reply.move, want)
            src = incoming.src
            if job.corrupt:
                # Every byte flipped, into a copy: what the transport lends may be read-only.
                src = src.view(torch.uint8).bitwise_xor(0x5A).view(src.dtype)
            # Still under the peer lock: the next pull from this peer reuses the bytes' place.
            scatter(src, self._kv, job.local_block_ids)
            del src, incoming.src  # no view of the transport's memory outlives the lock
            if incoming.landed:
                m.send(conn.sock, m.Landed(tk.transfer_id))  # it may let go of its copy now
        except (WireError, TransportError) as e:
            if not isinstance(e, TransportError) or conn.end.broken:
                peer.drop()
            raise
        except Exception:
            peer.drop()  # out of step with the producer (it may wait for our Landed): afresh
            raise
        return want, incoming.path

    def _release(self, tk: KVTicket) -> None:
        try:
            peer = self._peer(tk)
            with peer.lock:
                conn = self._connected(peer, tk)
                try:
                    m.send(conn.sock, m.Release(tk.transfer_id))
                    m.recv(conn.sock, m.Released)
                except WireError:
                    peer.drop()
                    raise
        except Exception as e:
            log.info("release of transfer %s at %s:%d failed (%s); its lease will expire",
                     tk.transfer_id, tk.host, tk.port, e)

    def _peer(self, tk: KVTicket) -> _Peer:
        with self._peers_lock:
            return self._peers.setdefault((tk.host, tk.port), _Peer(tk.host, tk.port))

    def _connected(self, peer: _Peer, tk: KVTicket) -> Connection:
        """The peer's connection, made now if it has none (caller holds `peer.lock`)."""
        if peer.conn is None:
            assert self._spec is not None and self._place is not None
            s = self.settings
            peer.conn = connect(peer.host, peer.port, engine_id=self.engine_id,
                                expect_engine_id=tk.engine_id, spec=self._spec,
                                secret=s.secret, timeout_s=s.timeout_s,
                                make_offers=lambda: consumer_offers(s, self._place, peer.host,
                                                                    peer.unusable))
        return peer.conn
