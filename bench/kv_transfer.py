"""KV transfer throughput: our pair channel and connector against their ceilings, per size.

    python bench/kv_transfer.py [--sizes-mb 1,16,128] [--repeats N] [--rounds R] [--json FILE]

Sizes are MiB (2**20 bytes); GB/s is bytes / seconds / 1e9. The network columns are measured by
the receiver (this process) from a sender in a spawned child, both on 127.0.0.1: after one
warm-up message the receiver starts its clock, sends a 1-byte "go", and receives `repeats`
messages sent back to back; the figure is repeats * size / elapsed (no round trip per message).
Per size, all methods run back to back, so a busy neighbour skews a row rather than a ratio.
The pair channel and raw TCP take turns `rounds` times per size (pair, TCP, pair, TCP, ...):
their columns are the medians of the rounds, and pair_vs_tcp the median of each round's ratio,
so one stall of a shared host (at 16 MiB a round is ~50 ms) does not decide the ratio.

Columns:
  pair_channel_gbps  a uint8 tensor from rank 0 to rank 1 over PairChannel (gloo on CPU); the
                     receiver recvs into the channel's reused staging buffer, as in production.
  tcp_loopback_gbps  raw TCP over loopback: sendall of a memoryview, recv_into a preallocated
                     buffer until it is full (TCP_NODELAY, as gloo). Gloo's CPU transport is
                     itself one TCP connection per peer pair and device, so this single stream
                     is the ceiling of the gloo path: gloo only adds framing, a send/recv
                     rendezvous per message and hand-offs to its event-loop thread.
  memcpy_gbps        dst.copy_(src) of uint8 tensors in one process: the local memory ceiling
                     (loopback TCP copies every byte at least twice, user -> kernel -> user).
  connector_gbps     the whole transport path: this process's Consumer pulls a PullJob from a
                     Producer in a child process (bench/kv_producer.py: gather -> side-channel
                     request -> pair channel -> scatter), timed submit -> result, a new held
                     transfer per repeat, with transport "pair" (what two hosts use). On top of
                     pair_channel: two copies (gather, scatter), a side-channel round trip.
  connector_shm_gbps the same pulls with transport "auto", which on one host takes the shared-
                     memory path (splitserve/kv/transport/shm.py: gather into the consumer's
                     segment -> side-channel reply -> scatter out of it; no pair channel).
  connector_arena_gbps  the same pulls from a producer that copies held blocks out at the hold
                     (the CPU default) into its shared hold arena: the consumer scatters straight
                     out of it (side-channel reply -> scatter -> Landed); the hold's copy is made
                     before the clock starts, as it is made before the decode side asks.
  pair_vs_tcp        pair_channel_gbps / tcp_loopback_gbps (1.0: gloo costs nothing over TCP).
  shm_vs_pair        connector_shm_gbps / connector_gbps: what one host gains over the wire path.
  arena_vs_shm       connector_arena_gbps / connector_shm_gbps: what reading the held copy where
                     it lies gains over a copy into the consumer's segment.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.kv_producer import ProducerProc
from splitserve.kv.consumer import Consumer, LoadResult, PullJob
from splitserve.kv.pair_channel import (
    CONSUMER_RANK,
    PRODUCER_RANK,
    PairChannel,
    connect_store,
    host_store,
)
from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.spec import spec_from_caches
from splitserve.kv.stats import TransferStats

MIB = 1 << 20
HOST = "127.0.0.1"
TIMEOUT_S = 30.0
CPU = torch.device("cpu")
# Connector cache: 2 layers of [blocks, 2 kv heads, 128 tokens, 128] bf16 = 128 KiB per block.
LAYERS, BLOCK_SHAPE, DTYPE = 2, (2, 128, 128), torch.bfloat16
BLOCK_BYTES = LAYERS * BLOCK_SHAPE[0] * BLOCK_SHAPE[1] * BLOCK_SHAPE[2] * DTYPE.itemsize
PRODUCER_ID = "bench-p"
DEFAULT_REPEATS = 10
DEFAULT_ROUNDS = 5
COLUMNS = ("pair_channel_gbps", "tcp_loopback_gbps", "memcpy_gbps", "connector_gbps",
           "connector_shm_gbps", "connector_arena_gbps", "pair_vs_tcp", "shm_vs_pair",
           "arena_vs_shm")
Measure = Callable[[int], float]  # size in bytes -> GB/s; called in the order its sender sends


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


@contextmanager
def child(target: Callable[..., None], *args: Any) -> Iterator[None]:
    """A spawned child for the block's duration: joined on success, killed on any error."""
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    try:
        yield
        proc.join(TIMEOUT_S)
        if proc.exitcode != 0:
            raise RuntimeError(f"{target.__name__} child ended with exit code {proc.exitcode}")
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()


def _die_with_parent() -> None:
    """In a spawned child: exit as soon as the parent is gone, however it ended (even SIGKILL)."""
    parent = mp.parent_process()
    assert parent is not None

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


# -- pair channel (gloo) and raw TCP: the sender is a child, the receiver this process ----------
def _sender_loop(send: Callable[[int], object], wait_flag: Callable[[], object], sizes: list[int],
                 repeats: int) -> None:
    for n in sizes:
        send(n)  # warm-up
        wait_flag()  # go
        for _ in range(repeats):
            send(n)
    wait_flag()  # done: all arrived, so closing the connection loses nothing


def _timed(recv: Callable[[int], object], go: Callable[[], object], n: int,
           repeats: int) -> float:
    """GB/s of `repeats` recv(n) after a warm-up one, the clock started just before go()."""
    recv(n)  # warm-up
    t0 = time.perf_counter()
    go()
    for _ in range(repeats):
        recv(n)
    return gbps(repeats * n, time.perf_counter() - t0)


def _pair_sender(store_port: int, pair_key: str, sizes: list[int], repeats: int) -> None:
    _die_with_parent()
    chan = PairChannel(connect_store(HOST, store_port, TIMEOUT_S), pair_key, PRODUCER_RANK, CPU,
                       TIMEOUT_S, HOST)
    buf, flag = torch.ones(max(sizes), dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    tags = itertools.count(1)  # both sides draw tags in the same order
    try:
        _sender_loop(lambda n: chan.send(buf[:n], next(tags)), lambda: chan.recv(flag, next(tags)),
                     sizes, repeats)
    finally:
        chan.close()


@contextmanager
def pair_channel(sizes: list[int], repeats: int) -> Iterator[Measure]:
    store, key = host_store(HOST, 0, TIMEOUT_S), f"bench/{uuid.uuid4().hex}"
    with child(_pair_sender, store.port, key, sizes, repeats):
        chan = PairChannel(store, key, CONSUMER_RANK, CPU, TIMEOUT_S, HOST)
        flag, tags = torch.ones(1, dtype=torch.uint8), itertools.count(1)
        try:
            yield lambda n: _timed(lambda k: chan.recv(chan.staging(k), next(tags)),
                                   lambda: chan.send(flag, next(tags)), n, repeats)
            chan.send(flag, next(tags))  # done
        finally:
            chan.close()


def _recv_full(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k


def _tcp_sender(port: int, sizes: list[int], repeats: int) -> None:
    _die_with_parent()
    buf, flag = memoryview(bytearray(max(sizes))), memoryview(bytearray(1))
    with socket.create_connection((HOST, port), timeout=TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as gloo does
        _sender_loop(lambda n: sock.sendall(buf[:n]), lambda: _recv_full(sock, flag), sizes,
                     repeats)


@contextmanager
def tcp_loopback(sizes: list[int], repeats: int) -> Iterator[Measure]:
    with socket.create_server((HOST, 0)) as srv:
        srv.settimeout(TIMEOUT_S)
        with child(_tcp_sender, srv.getsockname()[1], sizes, repeats):
            conn, buf = srv.accept()[0], memoryview(bytearray(max(sizes)))
            with conn:
                conn.settimeout(TIMEOUT_S)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                yield lambda n: _timed(lambda k: _recv_full(conn, buf[:k]),
                                       lambda: conn.sendall(b"g"), n, repeats)
                conn.sendall(b"d")


def memcpy(n: int, repeats: int) -> float:
    src, dst = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    return _timed(lambda _: dst.copy_(src), lambda: None, n, repeats)


# -- connector: a Producer child, this process's Consumer -----------------------------------------
def _caches(num_blocks: int) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.attn": torch.ones(num_blocks, *BLOCK_SHAPE, dtype=DTYPE)
            for i in range(LAYERS)}


class _SignalingConsumer(Consumer):
    """Sets `done` as each job finishes, so the clock stops at the result, not at a poll."""

    def __init__(self, transport: str) -> None:
        super().__init__("bench-d", ConnectorSettings(host=HOST, timeout_s=TIMEOUT_S,
                                                      transport=transport),
                         TransferStats(), max_workers=1)
        self.done = threading.Event()

    def _finish(self, result: LoadResult) -> None:
        super()._finish(result)
        self.done.set()


@contextmanager
def connector(sizes: list[int], repeats: int, transport: str,
              arena: bool = False) -> Iterator[Measure]:
    """Pulls over `transport`; `arena`: from a copy-out producer's shared hold arena."""
    max_blocks = max(1, round(max(sizes) / BLOCK_BYTES))
    # The arena holds two copies of the largest size: a pull's span is freed when the producer
    # reads the consumer's Landed, which can come after the next repeat's hold (that hold would
    # then miss the arena and take the shm path).
    prod = ProducerProc(num_layers=LAYERS, num_blocks=max_blocks, shape=list(BLOCK_SHAPE),
                        dtype="bfloat16", model="bench", block_size=BLOCK_SHAPE[1],
                        engine_id=PRODUCER_ID, lease_s=120.0, timeout_s=TIMEOUT_S,
                        copy_out=arena,
                        hold_arena_mib=-(-2 * max(sizes) // MIB) + 1 if arena else 0)
    cons = _SignalingConsumer(transport)
    try:
        caches = _caches(max_blocks)
        cons.start(caches, spec_from_caches("bench", BLOCK_SHAPE[1], caches))

        def pull(ids: list[int]) -> float:
            tid = uuid.uuid4().hex
            assert prod.cmd(op="hold", transfer_id=tid, block_ids=ids)["ok"]
            cons.done.clear()
            t0 = time.perf_counter()
            cons.submit(PullJob(tid, prod.ticket(tid, ids), ids, ids))
            if not cons.done.wait(2 * TIMEOUT_S):
                raise TimeoutError(f"pull of {len(ids)} blocks got no result")
            seconds = time.perf_counter() - t0
            (res,) = cons.take_results()
            if not res.ok:
                raise RuntimeError(f"pull failed: {res.error}")
            return seconds

        def measure(n: int) -> float:
            ids = list(range(max(1, round(n / BLOCK_BYTES))))
            seconds = [pull(ids) for _ in range(repeats + 1)]  # [0]: warm-up (and handshake)
            total = cons.stats.total
            # The first pull connects (the arena is made then, after its hold): all but it.
            if ((total.shm_transfers > 0) != (transport == "auto")
                    or arena and total.arena_transfers < total.transfers - 1):
                raise RuntimeError(f"transport {transport!r} (arena {arena}) took the wrong "
                                   f"path: {total}")
            return gbps(repeats * len(ids) * BLOCK_BYTES, sum(seconds[1:]))

        yield measure
    finally:
        cons.shutdown()
        prod.close()


# -- driver ----------------------------------------------------------------------------------------
def run(sizes_mb: list[int], repeats: int, rounds: int = DEFAULT_ROUNDS
        ) -> list[dict[str, float]]:
    sizes = [mb * MIB for mb in sizes_mb]
    turns = [n for n in sizes for _ in range(rounds)]  # what the two senders send, in order
    rows: list[dict[str, float]] = []
    with ExitStack() as stack:
        pair = stack.enter_context(pair_channel(turns, repeats))
        tcp = stack.enter_context(tcp_loopback(turns, repeats))
        pull = stack.enter_context(connector(sizes, repeats, "pair"))
        pull_shm = stack.enter_context(connector(sizes, repeats, "auto"))
        pull_arena = stack.enter_context(connector(sizes, repeats, "auto", arena=True))
        for mb, n in zip(sizes_mb, sizes, strict=True):
            both = [(pair(n), tcp(n)) for _ in range(rounds)]
            row = {"size_mb": mb, "pair_channel_gbps": statistics.median(p for p, _ in both),
                   "tcp_loopback_gbps": statistics.median(t for _, t in both),
                   "memcpy_gbps": memcpy(n, repeats), "connector_gbps": pull(n),
                   "connector_shm_gbps": pull_shm(n), "connector_arena_gbps": pull_arena(n)}
            rows.append({**row, "pair_vs_tcp": statistics.median(p / t for p, t in both),
                         "shm_vs_pair": row["connector_shm_gbps"] / row["connector_gbps"],
                         "arena_vs_shm": row["connector_arena_gbps"]
                         / row["connector_shm_gbps"]})
    return rows


def machine() -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_1m": os.getloadavg()[0]}


def table(rows: list[dict[str, float]]) -> str:
    lines = [f"{'size_mb':>8}" + "".join(f"{c:>19}" for c in COLUMNS) + "   (GB/s = 1e9 B/s)"]
    lines += [f"{r['size_mb']:>8}" + "".join(f"{r[c]:>19.2f}" for c in COLUMNS) for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description="KV transfer throughput (see the module docstring)")
    ap.add_argument("--sizes-mb", default="1,16,128", help="comma-separated sizes in MiB")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed messages per size")
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                    help="turns the pair channel and raw TCP take per size (medians reported)")
    ap.add_argument("--json", type=Path, help="also write the results to this file")
    args = ap.parse_args()
    sizes_mb = [int(s) for s in args.sizes_mb.split(",") if s.strip()]
    if not sizes_mb or min(sizes_mb) <= 0 or args.repeats <= 0 or args.rounds <= 0:
        ap.error("sizes, repeats and rounds must be positive")
    rows = run(sizes_mb, args.repeats, args.rounds)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "machine": machine(),
                                         "repeats": args.repeats, "rounds": args.rounds},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
