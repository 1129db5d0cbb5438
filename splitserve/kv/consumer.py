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
would hold its blocks forever.

Connections are per producer address and reused; a failed connection (and its pair channel) is
dropped and the next job to that producer handshakes afresh. Jobs to different producers run in
parallel, jobs to one producer in order.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from splitserve.kv import blocks
from splitserve.kv.pair_channel import CONSUMER_RANK, PairChannel, TransferError, connect_store
from splitserve.kv.spec import KVSpec
from splitserve.kv.stats import TransferStats
from splitserve.kv.wire import WireError, auth_proof, recv_msg, send_msg

log = logging.getLogger(__name__)


class IncompatiblePeer(TransferError):
    """The producer refused the handshake (different model/dtype/layout, or bad secret)."""


@dataclass(frozen=True, slots=True)
class PullJob:
    req_id: str  # this engine's internal request id (reported back to vLLM)
    transfer_id: str  # the producer's key for the held blocks
    host: str
    port: int
    engine_id: str | None  # the producer we expect to reach at host:port
    local_block_ids: list[int]
    remote_block_ids: list[int]  # same length, position for position
    corrupt: bool = False  # fault injection (tests): flip the received bytes


@dataclass(frozen=True, slots=True)
class LoadResult:
    req_id: str
    ok: bool
    block_ids: list[int]  # the local blocks, invalid when not ok
    error: str | None = None


class _Peer:
    def __init__(self, sock: socket.socket, chan: PairChannel) -> None:
        self.sock, self.chan = sock, chan
        self.lock = threading.Lock()

    def close(self) -> None:
        self.chan.close()
        self.sock.close()


class Consumer:
    def __init__(self, engine_id: str, host: str, timeout_s: float, secret: str | None,
                 stats: TransferStats, max_workers: int = 4) -> None:
        self.engine_id = engine_id
        self.host = host
        self.timeout_s = timeout_s
        self.secret = secret
        self.stats = stats
        self._kv: dict[str, torch.Tensor] = {}
        self._spec: KVSpec | None = None
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-pull")
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._peers_lock = threading.Lock()
        self._results: list[LoadResult] = []
        self._results_lock = threading.Lock()
        self._tags = itertools.count(1)

    def start(self, kv_caches: dict[str, torch.Tensor], spec: KVSpec) -> None:
        self._kv, self._spec = kv_caches, spec

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._peers_lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()

    # -- called from the connector's worker half (engine thread) -----------------------------
    def submit(self, job: PullJob) -> None:
        self._pool.submit(self._run, job)

    def release(self, transfer_id: str, host: str, port: int, engine_id: str | None) -> None:
        """Tell the producer we will not pull `transfer_id` (best effort; its lease is the net)."""
        self._pool.submit(self._release, transfer_id, host, port, engine_id)

    def take_results(self) -> list[LoadResult]:
        with self._results_lock:
            out, self._results = self._results, []
        return out

    # -- pool threads ------------------------------------------------------------------------
    def _run(self, job: PullJob) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = self._pull(job)
        except Exception as e:  # any failure must still come back as a result
            self.stats.record_failure()
            log.warning("KV load for %s (transfer %s from %s:%d) failed: %s", job.req_id,
                        job.transfer_id, job.host, job.port, e)
            self._finish(LoadResult(job.req_id, False, job.local_block_ids, str(e)))
        else:
            self.stats.record_transfer(nbytes, time.perf_counter() - t0)
            self._finish(LoadResult(job.req_id, True, job.local_block_ids))

    def _finish(self, result: LoadResult) -> None:
        with self._results_lock:
            self._results.append(result)

    def _pull(self, job: PullJob) -> int:
        assert len(job.local_block_ids) == len(job.remote_block_ids)
        peer = self._peer(job.host, job.port, job.engine_id)
        with peer.lock:
            try:
                tag = next(self._tags)
                send_msg(peer.sock, {"op": "pull", "transfer_id": job.transfer_id,
                                     "block_ids": job.remote_block_ids, "tag": tag})
                reply = recv_msg(peer.sock)
                if not reply.get("ok"):
                    # The producer refused this transfer; the connection itself is fine.
                    raise TransferError(f"producer refused: {reply.get('error')}")
                n = len(job.local_block_ids)
                nbytes = int(reply["nbytes"])
                if nbytes != blocks.staging_bytes(self._kv, n):
                    peer.chan.close()  # out of step with the producer: start a fresh pair
                    raise TransferError(f"producer announced {nbytes} bytes for {n} blocks")
                raw = peer.chan.staging(nbytes)
                peer.chan.recv(raw, tag)
            except (WireError, TransferError) as e:
                if not isinstance(e, TransferError) or peer.chan.closed:
                    self._drop(job.host, job.port, peer)
                raise
            if job.corrupt:
                raw.bitwise_xor_(0x5A)
            # Still under the peer lock: the next pull from this peer reuses the staging buffer.
            blocks.scatter(blocks.staging_view(raw, self._kv, n), self._kv, job.local_block_ids)
        return nbytes

    def _release(self, transfer_id: str, host: str, port: int, engine_id: str | None) -> None:
        try:
            peer = self._peer(host, port, engine_id)
            with peer.lock:
                send_msg(peer.sock, {"op": "release", "transfer_id": transfer_id})
                recv_msg(peer.sock)
        except Exception as e:
            log.info("release of transfer %s at %s:%d failed (%s); its lease will expire",
                     transfer_id, host, port, e)

    def _peer(self, host: str, port: int, engine_id: str | None) -> _Peer:
        with self._peers_lock:
            peer = self._peers.get((host, port))
            if peer is None:
                peer = self._connect(host, port, engine_id)
                self._peers[(host, port)] = peer
            return peer

    def _drop(self, host: str, port: int, peer: _Peer) -> None:
        with self._peers_lock:
            if self._peers.get((host, port)) is peer:
                del self._peers[(host, port)]
        peer.close()

    def _connect(self, host: str, port: int, engine_id: str | None) -> _Peer:
        assert self._spec is not None
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout_s)
        except OSError as e:
            raise TransferError(f"cannot reach KV producer at {host}:{port}: {e}") from e
        try:
            challenge = recv_msg(sock)
            pair_key = f"{challenge.get('engine_id')}/{self.engine_id}/{uuid.uuid4().hex}"
            send_msg(sock, {"op": "hello", "engine_id": self.engine_id, "pair_key": pair_key,
                            "expect_engine_id": engine_id, "spec": self._spec.to_dict(),
                            "proof": auth_proof(self.secret, challenge["challenge"])
                            if self.secret else ""})
            reply = recv_msg(sock)
            if not reply.get("ok"):
                raise IncompatiblePeer(
                    f"KV producer at {host}:{port} refused: {reply.get('error')}")
            store = connect_store(host, int(reply["store_port"]), self.timeout_s)
            device = next(iter(self._kv.values())).device
            chan = PairChannel(store, pair_key, CONSUMER_RANK, device, self.timeout_s, self.host)
        except BaseException:
            sock.close()
            raise
        log.info("KV pair channel %s up", pair_key)
        return _Peer(sock, chan)
