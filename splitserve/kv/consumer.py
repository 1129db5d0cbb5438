"""Consumer (decode) side of a pull transfer, running in vLLM's worker process.

Lifecycle of one load here:
  submit(job)      the scheduler half parked request R in WAITING_FOR_REMOTE_KVS with fresh
                   local blocks; a pool thread takes the job so the engine step never blocks.
  pull             over the producer's side channel: "send blocks X of transfer T"; the bytes
                   arrive over the pair channel into a staging buffer and are scattered into R's
                   local blocks (nobody else can touch those blocks while R is parked).
  take_results()   R is reported finished (and failed, with its blocks, if the pull failed) on
                   the next engine step; vLLM then decodes R or applies the failure policy.
Every job ends in take_results(), success or not: a parked request whose id never comes back
would hold its blocks forever. load_now(job) is the in-step form (the default, `load="sync"`):
the same pull on the engine's thread, before the forward pass that reads the blocks.
load_layered(job) (`load="layered"`) runs it on a helper thread beside that forward pass, which
waits for each layer's blocks before it reads them (layered.py).

One connection per producer address, made on first use and reused; a producer that shares this
host's memory takes the connection's bytes through our shared-memory segment instead of a pair
channel (shm.py, chosen in the handshake); a failed connection (and its
pair channel) is dropped and the next job to that producer handshakes afresh. Each connection has
its own lock, taken for the connect as well as for each transfer: jobs to one producer run in
order, and a slow or dead producer (a connect or handshake waiting out its timeout) never delays
jobs to any other. A producer that let a load wait out its timeout and lost the link (hung,
unreachable) is marked down for `timeout_s`: loads from it fail at once (and vLLM recomputes or
fails them by policy) instead of each waiting out a timeout, which in-step would stall the
whole decode batch once per request.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from splitserve import faults
from splitserve.kv import blocks
from splitserve.kv.layered import LayeredScatter, leave_engine_cores
from splitserve.kv.link import Link
from splitserve.kv.pair_channel import CONSUMER_RANK, PairChannel, TransferError, connect_store
from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.shm import ConsumerStaging
from splitserve.kv.spec import KVSpec
from splitserve.kv.stats import TransferStats
from splitserve.kv.ticket import KVTicket
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

# A pull's path: the pair channel, our shared segment, or the producer's hold arena (shm.py).
PAIR, SHM, ARENA = "pair", "shm", "arena"

# How a pull's bytes go from the staging buffer into the local blocks: blocks.scatter, or a
# LayeredScatter that lets the forward pass start before it ends (layered.py).
Scatter = Callable[[torch.Tensor, dict[str, torch.Tensor], list[int]], None]


class IncompatiblePeer(TransferError):
    """The handshake failed: the producer refused us (different model/dtype/layout, bad secret)
    or could not prove the shared secret itself."""


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
        self.conn: Link[ConsumerStaging] | None = None
        self.shm_ok = True  # False once /dev/shm had no room: the pair channel from then on
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
        raise TransferError(f"KV producer at {peer.host}:{peer.port} is marked down for "
                            f"{left:.1f} s more (a load from it timed out)")


class Consumer:
    def __init__(self, engine_id: str, settings: ConnectorSettings, stats: TransferStats,
                 max_workers: int = 4) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.stats = stats
        self._faults = faults.for_host(settings.host)
        self._kv: dict[str, torch.Tensor] = {}
        self._spec: KVSpec | None = None
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-pull")
        # Layered in-step loads (one per step at most), beside the engine's forward pass.
        self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-layered",
                                          initializer=leave_engine_cores)
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._peers_lock = threading.Lock()  # guards the dict only, never held across I/O
        self._results: list[LoadResult] = []
        self._results_lock = threading.Lock()
        self._tags = itertools.count(1)

    def start(self, kv_caches: dict[str, torch.Tensor], spec: KVSpec) -> None:
        self._kv, self._spec = kv_caches, spec

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
        self.stats.record_transfer(nbytes, time.perf_counter() - t0, path != PAIR,
                                   arena=path == ARENA)
        return None

    def _finish(self, result: LoadResult) -> None:
        with self._results_lock:
            self._results.append(result)

    def _pull(self, job: PullJob, scatter: Scatter) -> tuple[int, str]:
        """The bytes moved, and their path (PAIR, SHM or ARENA)."""
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
        n = len(job.local_block_ids)
        want = blocks.staging_bytes(self._kv, n)
        if conn.shm is not None:
            try:
                conn.shm.buffer(want)
            except OSError as e:
                log.warning("no room in /dev/shm for a %d-byte KV segment (%s): transfers "
                            "from %s:%d take the pair channel from now on", want, e,
                            peer.host, peer.port)
                peer.shm_ok = False
                peer.drop()
                conn = self._connected(peer, tk)
        if tk.spec_fingerprint and tk.spec_fingerprint != self._spec.fingerprint():
            # The handshake passed, so this producer's cache matches ours: the ticket was
            # issued by another incarnation at this address. Its block ids mean nothing here.
            raise IncompatiblePeer(f"ticket {tk.transfer_id} names a KV cache with spec "
                                   f"{tk.spec_fingerprint}, ours is {self._spec.fingerprint()}")
        try:
            tag = next(self._tags)
            msg = {"op": "pull", "transfer_id": tk.transfer_id,
                   "block_ids": job.remote_block_ids, "tag": tag}
            if conn.shm is not None:
                msg["shm"] = conn.shm.buffer(want).name  # the producer writes the bytes here
                msg["arena"] = True  # ... or tells us where its held copy lies
            send_msg(conn.sock, msg)
            reply = recv_msg(conn.sock)
            if not reply.get("ok"):
                # The producer refused this transfer; the connection itself is fine.
                raise TransferError(f"producer refused: {reply.get('error')}")
            nbytes = int(reply["nbytes"])
            if nbytes != want:
                peer.drop()  # out of step with the producer: start afresh
                raise TransferError(f"producer announced {nbytes} bytes for {n} blocks")
            if conn.shm is not None and reply.get("arena"):
                src = self._held(peer, conn.shm, reply["arena"], n)
                path = ARENA
            else:
                if conn.shm is not None:
                    raw = conn.shm.buffer(nbytes).tensor(nbytes)  # already there
                    path = SHM
                else:
                    assert conn.chan is not None
                    raw = conn.chan.staging(nbytes)
                    conn.chan.recv(raw, tag)
                    path = PAIR
                src = blocks.staging_view(raw, self._kv, n)
                del raw
            if job.corrupt:
                # Every byte flipped, into a copy: the arena is read-only to us.
                src = src.view(torch.uint8).bitwise_xor(0x5A).view(src.dtype)
            # Still under the peer lock: the next pull from this peer reuses the staging buffer.
            scatter(src, self._kv, job.local_block_ids)
            del src  # no view of a shared segment outlives the lock (it may be replaced)
            if path == ARENA:
                # The producer keeps the span until we say so (and then frees it).
                send_msg(conn.sock, {"op": "read", "transfer_id": tk.transfer_id})
        except (WireError, TransferError) as e:
            if not isinstance(e, TransferError) or conn.broken:
                peer.drop()
            raise
        except Exception:
            peer.drop()  # out of step with the producer (it may wait for our "read"): afresh
            raise
        return nbytes, path

    def _held(self, peer: _Peer, staging: ConsumerStaging, where: dict, n: int) -> torch.Tensor:
        """The producer's held copy of the pull's `n` blocks, as a staging view into its arena
        (the positions of ours among the held ones when they are a subset: a copy then)."""
        try:
            held = int(where["blocks"])
            positions = where.get("positions")
            raw = staging.held(where["name"], int(where["offset"]),
                               blocks.staging_bytes(self._kv, held))
        except (KeyError, TypeError, ValueError, OSError) as e:
            peer.drop()  # out of step with the producer: start afresh
            raise TransferError(f"producer's hold arena: {e}") from e
        view = blocks.staging_view(raw, self._kv, held)
        if positions is None and held == n:
            return view
        if (not isinstance(positions, list) or len(positions) != n
                or not all(isinstance(i, int) and 0 <= i < held for i in positions)):
            peer.drop()
            raise TransferError(f"producer's hold arena: positions {positions} do not pick "
                                f"{n} of its {held} held blocks")
        return view.index_select(1, torch.tensor(positions, dtype=torch.long))

    def _release(self, tk: KVTicket) -> None:
        try:
            peer = self._peer(tk)
            with peer.lock:
                conn = self._connected(peer, tk)
                try:
                    send_msg(conn.sock, {"op": "release", "transfer_id": tk.transfer_id})
                    recv_msg(conn.sock)
                except WireError:
                    peer.drop()
                    raise
        except Exception as e:
            log.info("release of transfer %s at %s:%d failed (%s); its lease will expire",
                     tk.transfer_id, tk.host, tk.port, e)

    def _peer(self, tk: KVTicket) -> _Peer:
        with self._peers_lock:
            return self._peers.setdefault((tk.host, tk.port), _Peer(tk.host, tk.port))

    def _connected(self, peer: _Peer, tk: KVTicket) -> Link[ConsumerStaging]:
        """The peer's connection, made now if it has none (caller holds `peer.lock`)."""
        if peer.conn is None:
            peer.conn = self._connect(peer.host, peer.port, tk.engine_id, peer.shm_ok)
        return peer.conn

    def _connect(self, host: str, port: int, engine_id: str | None,
                 shm_ok: bool) -> Link[ConsumerStaging]:
        assert self._spec is not None
        s = self.settings
        try:
            sock = no_delay(socket.create_connection((host, port), timeout=s.timeout_s))
        except OSError as e:
            raise TransferError(f"cannot reach KV producer at {host}:{port}: {e}") from e
        device = next(iter(self._kv.values())).device
        shm = None
        if shm_ok and s.shares_memory(device.type):
            try:
                shm = ConsumerStaging()
            except OSError as e:
                log.warning("no shared-memory KV segment (%s): the pair channel", e)
        try:
            first = recv_msg(sock)
            if first.get("op") != "challenge" or not isinstance(first.get("challenge"), str):
                raise IncompatiblePeer(f"KV producer at {host}:{port} refused: "
                                       f"{first.get('error', 'no challenge')}")
            theirs, ours = first["challenge"], secrets.token_hex(16)
            pair_key = f"{first.get('engine_id')}/{self.engine_id}/{uuid.uuid4().hex}"
            hello = {"op": "hello", "engine_id": self.engine_id, "pair_key": pair_key,
                     "expect_engine_id": engine_id or None, "spec": self._spec.to_dict(),
                     "challenge": ours,
                     "proof": auth_proof(s.secret, CONSUMER, theirs, ours, pair_key)
                     if s.secret else ""}
            if shm is not None:
                hello["shm"] = shm.offer()
            send_msg(sock, hello)
            reply = recv_msg(sock)
            if not reply.get("ok"):
                raise IncompatiblePeer(
                    f"KV producer at {host}:{port} refused: {reply.get('error')}")
            store_port = str(reply.get("store_port"))
            shared = shm is not None and reply.get("shm") is True
            # The producer proves the secret too, before we go near the store it names (or
            # trust it with our memory): a peer without it could otherwise pose as a producer
            # and feed us bytes.
            if s.secret and not check_proof(s.secret, PRODUCER, theirs, ours,
                                            f"{store_port}/shm" if shared else store_port,
                                            reply.get("proof")):
                raise IncompatiblePeer(f"KV producer at {host}:{port} did not prove the shared "
                                       f"secret: authentication failed")
            if shared:
                log.info("KV link %s up through shared memory (%s)", pair_key, shm.segment.name)
                return Link(None, shm, sock)
            if shm is not None:
                shm.close()  # not taken: another host (or IPC namespace)
                shm = None
            store = connect_store(host, int(store_port), s.timeout_s)
            chan = PairChannel(store, pair_key, CONSUMER_RANK, device, s.timeout_s, s.host)
        except BaseException:
            if shm is not None:
                shm.close()
            sock.close()
            raise
        log.info("KV pair channel %s up", pair_key)
        return Link(chan, None, sock)
