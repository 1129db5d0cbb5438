"""Producer (prefill) side of a pull transfer, running in vLLM's worker process.

Lifecycle of one transfer here:
  hold(T, blocks)   the scheduler half finished request T with max_tokens=1 and kept its blocks;
                    they are now held under a lease (vLLM will not reuse them until we say so).
                    In copy-out mode (the CPU default) their bytes are copied out right here and
                    the blocks go back to vLLM at once; the copy is what the lease holds.
  pull(T, ids)      a consumer asks over the side channel; the blocks are gathered into the
                    pair's staging buffer, T is marked finished (the gather copied them, so vLLM
                    may free and reuse the blocks at once), then the bytes go over the pair channel.
  release(T)        a consumer that needs nothing (full prefix hit, abort) lets go early.
  lease expiry      nobody pulled in time: T is marked finished, and a late pull is refused
                    explicitly instead of reading blocks that may already belong to someone else.
`take_finished()` hands finished ids to vLLM (as `finished_sending`), which frees the blocks.

One thread per consumer connection serves its pulls in order; each connection owns one pair
channel (a 2-rank process group), so pairs never contend for a group or a staging buffer.
"""

from __future__ import annotations

import collections
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass

import torch

from splitserve.kv import blocks
from splitserve.kv.pair_channel import PRODUCER_RANK, PairChannel, TransferError, host_store
from splitserve.kv.spec import KVSpec
from splitserve.kv.stats import TransferStats
from splitserve.kv.wire import WireError, check_proof, recv_msg, send_msg

log = logging.getLogger(__name__)

# How long a pull waits for its transfer to be registered: the consumer can learn the transfer
# params (via the router) before this engine's next step has told the worker about them.
REGISTER_WAIT_S = 5.0
_RECENTLY_EXPIRED = 4096


@dataclass(slots=True)
class _Held:
    block_ids: list[int]
    expires_at: float  # time.monotonic() of this process
    # Copy-out mode: the blocks' bytes ([L, n, H, N, words]), taken when the hold began, so vLLM
    # got its blocks back at once (`returned`) and pulls are served from here.
    snapshot: torch.Tensor | None = None
    returned: bool = False  # already reported to vLLM as finished_sending


class Producer:
    def __init__(self, engine_id: str, host: str, side_port: int, lease_s: float,
                 timeout_s: float, secret: str | None, stats: TransferStats,
                 stall_before_send_s: float = 0.0, copy_out: bool = False) -> None:
        self.engine_id = engine_id
        self.host = host
        self.side_port = side_port
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.secret = secret
        self.stats = stats
        self.stall_before_send_s = stall_before_send_s  # fault injection for kill tests only
        self.copy_out = copy_out
        self._cond = threading.Condition()
        self._held: dict[str, _Held] = {}
        self._finished: set[str] = set()
        self._expired: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._kv: dict[str, torch.Tensor] = {}
        self._spec: KVSpec | None = None
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._store = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, kv_caches: dict[str, torch.Tensor], spec: KVSpec) -> None:
        self._kv, self._spec = kv_caches, spec
        self._store = host_store(self.host, 0, self.timeout_s)
        sock = socket.create_server((self.host, self.side_port))
        self.side_port = sock.getsockname()[1]  # the real port when asked for port 0
        sock.settimeout(0.5)  # lets the accept loop notice shutdown
        self._sock = sock
        threading.Thread(target=self._accept_loop, name="kv-producer-accept", daemon=True).start()
        log.info("KV producer %s listening on %s:%d (store port %d)", self.engine_id, self.host,
                 self.side_port, self._store.port)

    def shutdown(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()

    # -- called from the connector's worker half (engine thread) -----------------------------
    def hold(self, transfer_id: str, block_ids: list[int]) -> None:
        held = _Held(list(block_ids), time.monotonic() + self.lease_s)
        if self.copy_out:
            # Copy the blocks out now and give them back to vLLM with this very step: an engine
            # holding finished requests' blocks keeps stepping (busy) until they are freed, which
            # on a CPU host steals the cores its own server and its neighbours need.
            n = len(block_ids)
            snap = torch.empty(blocks.staging_bytes(self._kv, n), dtype=torch.uint8,
                               device=next(iter(self._kv.values())).device)
            blocks.gather(self._kv, held.block_ids, blocks.staging_view(snap, self._kv, n))
            held.snapshot, held.returned = snap, True
        with self._cond:
            self._held[transfer_id] = held
            if held.returned:
                self._finished.add(transfer_id)
            self._cond.notify_all()

    def take_finished(self) -> set[str]:
        """Transfers whose blocks vLLM may free now: sent, released, or lease expired."""
        with self._cond:
            self._reap()
            done, self._finished = self._finished, set()
        return done

    def _reap(self) -> None:
        """Expire leases (caller holds the lock). Runs on engine steps, on every claim, and
        twice a second from the accept loop: an idle engine takes no steps, and a copied-out
        transfer must still expire (and free its memory) on time."""
        now = time.monotonic()
        for tid in [t for t, h in self._held.items() if h.expires_at <= now]:
            held = self._held.pop(tid)
            self._expired[tid] = None
            if len(self._expired) > _RECENTLY_EXPIRED:
                self._expired.popitem(last=False)
            if not held.returned:
                self._finished.add(tid)
            self.stats.record_lease_expired()
            log.warning("KV lease expired for transfer %s after %.1f s: blocks freed unsent",
                            tid, self.lease_s)

    @property
    def num_held(self) -> int:
        with self._cond:
            return len(self._held)

    # -- side channel ------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                with self._cond:
                    self._reap()
                continue
            except OSError:
                return  # socket closed by shutdown()
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name=f"kv-producer-{addr[0]}:{addr[1]}").start()

    def _serve(self, conn: socket.socket, addr) -> None:
        chan: PairChannel | None = None
        conn.settimeout(self.timeout_s)
        try:
            chan = self._handshake(conn)
            if chan is None:
                return
            conn.settimeout(None)  # idle connections are fine; each request has its own bounds
            while not self._stop.is_set():
                msg = recv_msg(conn)
                conn.settimeout(self.timeout_s)
                op = msg.get("op")
                if op == "pull":
                    self._serve_pull(conn, chan, msg)
                elif op == "release":
                    self._release(str(msg.get("transfer_id")))
                    send_msg(conn, {"ok": True})
                else:
                    send_msg(conn, {"ok": False, "error": f"unknown op {op!r}"})
                conn.settimeout(None)
        except (WireError, TransferError) as e:
            log.info("KV consumer %s disconnected: %s", addr, e)
        finally:
            if chan is not None:
                chan.close()
            conn.close()

    def _handshake(self, conn: socket.socket) -> PairChannel | None:
        assert self._spec is not None and self._store is not None
        challenge = secrets.token_hex(16)
        send_msg(conn, {"op": "challenge", "challenge": challenge, "engine_id": self.engine_id})
        hello = recv_msg(conn)
        if hello.get("op") == "status":  # counts only, no secret needed: leak checks, Stats
            with self._cond:
                self._reap()
                send_msg(conn, {"ok": True, "held_transfers": len(self._held),
                                "held_blocks": sum(len(h.block_ids) for h in self._held.values())})
            return None
        error = None
        if self.secret and not check_proof(self.secret, challenge, str(hello.get("proof", ""))):
            error = "authentication failed: wrong or missing shared secret"
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
        send_msg(conn, {"ok": True, "store_port": self._store.port})
        device = next(iter(self._kv.values())).device
        return PairChannel(self._store, str(hello["pair_key"]), PRODUCER_RANK, device,
                           self.timeout_s, self.host)

    def _serve_pull(self, conn: socket.socket, chan: PairChannel, msg: dict) -> None:
        tid = str(msg.get("transfer_id"))
        want = [int(b) for b in msg.get("block_ids", [])]
        held, error = self._claim(tid)
        if held is not None and not set(want) <= set(held.block_ids):
            error = f"transfer {tid}: requested blocks are not among the held ones"
            self._release(tid)
        if error:
            send_msg(conn, {"ok": False, "error": error})
            return
        t0 = time.perf_counter()
        nbytes = blocks.staging_bytes(self._kv, len(want))
        if held.snapshot is not None and want == held.block_ids:
            raw = held.snapshot  # the common case: everything, in order, already contiguous
        elif held.snapshot is not None:
            raw = chan.staging(nbytes)
            pos = [held.block_ids.index(b) for b in want]
            snap = blocks.staging_view(held.snapshot, self._kv, len(held.block_ids))
            torch.index_select(snap, 1, torch.tensor(pos, device=snap.device),
                               out=blocks.staging_view(raw, self._kv, len(want)))
        else:
            raw = chan.staging(nbytes)
            blocks.gather(self._kv, want, blocks.staging_view(raw, self._kv, len(want)))
        self._release(tid)  # copied (or ours): vLLM may reuse the blocks from now on
        send_msg(conn, {"ok": True, "nbytes": nbytes})
        if self.stall_before_send_s:
            time.sleep(self.stall_before_send_s)
        try:
            chan.send(raw, int(msg["tag"]))
        except TransferError:
            self.stats.record_failure()
            raise
        self.stats.record_transfer(nbytes, time.perf_counter() - t0)

    def _claim(self, tid: str) -> tuple[_Held | None, str | None]:
        """The held transfer `tid`, waiting briefly for it to be registered."""
        # Half the transfer timeout at most: the consumer must hear "unknown" before it gives up.
        deadline = time.monotonic() + min(REGISTER_WAIT_S, self.timeout_s / 2)
        with self._cond:
            self._reap()
            while tid not in self._held:
                if tid in self._expired:
                    return None, f"transfer {tid}: lease expired before the pull; blocks freed"
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, f"transfer {tid}: unknown to this producer (never held, or freed)"
                self._cond.wait(left)
            return self._held[tid], None

    def _release(self, tid: str) -> None:
        with self._cond:
            held = self._held.pop(tid, None)
            if held is not None and not held.returned:
                self._finished.add(tid)


def query_status(host: str, port: int, timeout_s: float = 2.0) -> dict:
    """What a producer holds right now ({"held_transfers", "held_blocks"}), over its side
    channel. Used by the prefill worker's Stats RPC and by leak checks."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        recv_msg(sock)  # the challenge; a status query needs no answer to it
        send_msg(sock, {"op": "status"})
        return recv_msg(sock)
