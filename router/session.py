"""The router's side of a decode session: one stream to a decode worker, shared by its requests.

Lifecycle: opened on the first request to the worker (and again after it broke) → `start(req)`
registers the request's inbox and sends `start` → a reader task takes the worker's batches and
puts each event in its request's inbox → the request's consumer (flow.py) takes what its inbox
holds until the finish event → `cancel_soon(id)` when it stops early. If the stream breaks
(worker gone), every request still on it gets a `Broken` carrying the status; the next `start`
opens afresh. One writer task per stream sends what `start` and `cancel_soon` queue, in order
(a gRPC stream takes one write at a time).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass

import grpc

from splitserve.v1 import worker_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Broken:
    """Put on a request's queue when its session ended before the request did."""

    code: grpc.StatusCode
    message: str


class Inbox:
    """One request's events, in arrival order. Lighter than an asyncio.Queue (one consumer, no
    bound: the per-token path runs through it) and drained whole: events that arrived while the
    consumer was busy are taken together and become one message to the client."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put(self, event) -> None:
        self._items.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def take(self) -> list:
        """Every event waiting, at least one (waits for it)."""
        await self._wait()
        items = list(self._items)
        self._items.clear()
        return items

    async def get(self):
        """The next event (waits for it)."""
        await self._wait()
        return self._items.popleft()


class DecodeSession:
    def __init__(self, stub, name: str) -> None:
        self._stub = stub  # DecodeWorkerStub
        self._name = name
        self._call = None
        self._queues: dict[str, Inbox] = {}
        # What start and cancel_soon send, in order, for the writer of the stream now open.
        self._outbox: collections.deque[worker_pb2.SessionRequest] = collections.deque()
        self._pending = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self, req: worker_pb2.DecodeRequest) -> Inbox:
        """The inbox the request's events (or a Broken) will arrive in. Request ids must be
        unique among the requests running on this session (the router makes them so).

        Does not wait for the write: the writer task sends it, and the request's coroutine wakes
        once, for its first event. Awaiting each write cost a task, a lock and a wake-up per
        request on the way to the first token, and its shield (a request cancelled mid-write
        must not cancel the shared stream) is not needed when no request writes."""
        if req.request_id in self._queues:
            raise ValueError(f"request {req.request_id!r} is already running on {self._name}")
        q = Inbox()
        try:
            # Fails when the worker was dropped (its channel closed) after this request was
            # routed to it: a worker failure like any other, so it migrates.
            self._open()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            q.put(Broken(grpc.StatusCode.UNAVAILABLE,
                         f"decode session to {self._name} is down: {e}"))
            return q
        self._queues[req.request_id] = q
        self._send(worker_pb2.SessionRequest(start=req))
        return q

    def cancel_soon(self, request_id: str) -> None:
        """Stop the request on the worker (without waiting: callers may be unwinding)."""
        if self._queues.pop(request_id, None) is None or self._call is None:
            return
        self._send(worker_pb2.SessionRequest(cancel=request_id))

    def _send(self, msg: worker_pb2.SessionRequest) -> None:
        self._outbox.append(msg)
        self._pending.set()

    def _open(self):
        if self._call is None:
            self._call = call = self._stub.DecodeSession()
            self._writer = self._spawn(self._write(call))
            self._spawn(self._read(call))
        return self._call

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _write(self, call) -> None:
        """Sends the outbox on `call`, one message at a time (a gRPC stream takes one write at
        a time). A stream that cannot be written to is ended, whatever the error: the reader
        then fails its requests (they migrate) instead of their starts waiting unsent."""
        try:
            while True:
                await self._pending.wait()
                self._pending.clear()
                while self._outbox:
                    await call.write(self._outbox.popleft())
        except Exception as e:
            log.info("decode session to %s: write failed (%s: %s); ending the stream",
                     self._name, type(e).__name__, e)
            call.cancel()

    async def _read(self, call) -> None:
        broken = Broken(grpc.StatusCode.UNAVAILABLE, f"decode session to {self._name} ended")
        try:
            while True:
                batch = await call.read()
                if batch is grpc.aio.EOF:
                    break
                for ev in batch.events:
                    last = ev.error_code or ev.output.HasField("finish_reason")
                    q = (self._queues.pop if last else self._queues.get)(ev.request_id, None)
                    if q is not None:
                        q.put(ev)
        except grpc.aio.AioRpcError as e:
            broken = Broken(grpc.StatusCode.UNAVAILABLE,
                            f"decode session to {self._name} broke: {e.code().name}: "
                            f"{e.details()}")
        except asyncio.CancelledError:
            pass  # closed by us
        finally:
            if self._call is call:
                self._call = None
                # What was queued for this stream must not start on the next one: its requests
                # get Broken below and migrate.
                self._outbox.clear()
                if self._writer is not None:
                    self._writer.cancel()
            for q in self._queues.values():
                q.put(broken)
            self._queues.clear()

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
