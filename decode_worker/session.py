"""The worker's side of a decode session: many requests over one stream, answered in batches.

Lifecycle of a session: the router opens the stream → each `start` runs its request in a task
of its own, whose outputs go to one shared outbox → the stream sends the outbox whenever it is
not empty: the requests whose tokens came out of one engine step wake together, so one batch
carries them all → `cancel` cancels the request's task (which aborts it in the engine) → a
request that fails sends one error event with the status it would have had → when the router
goes away, every request still running is cancelled. One message per step instead of one per
token per request is what keeps the relay cheap on both sides (gRPC costs ~90 µs a message).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from splitserve.v1 import worker_pb2
from splitserve.worker.errors import PermissionDenied, Unavailable

log = logging.getLogger(__name__)

# Runs one request: its outputs, in order; ValueError = bad input, Unavailable = not now.
RunRequest = Callable[[worker_pb2.DecodeRequest], AsyncIterator[worker_pb2.DecodeResponse]]


class Session:
    def __init__(self, run: RunRequest) -> None:
        self._run = run
        self._outbox: list[worker_pb2.SessionEvent] = []
        self._wake = asyncio.Event()
        self._tasks: dict[str, asyncio.Task] = {}
        self._reading = True

    async def serve(self, requests: AsyncIterator[worker_pb2.SessionRequest]
                    ) -> AsyncIterator[worker_pb2.SessionBatch]:
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._outbox:
                    batch, self._outbox = self._outbox, []
                    yield worker_pb2.SessionBatch(events=batch)
                elif not self._reading and not self._tasks:
                    return  # the router closed its side and nothing is left to send
        finally:
            reader.cancel()
            tasks = list(self._tasks.values())
            for t in tasks:
                t.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[worker_pb2.SessionRequest]) -> None:
        try:
            async for msg in requests:
                if msg.HasField("start"):
                    self._start(msg.start)
                elif msg.cancel:
                    task = self._tasks.get(msg.cancel)
                    if task is not None:
                        task.cancel()
        finally:
            self._reading = False
            self._wake.set()

    def _start(self, req: worker_pb2.DecodeRequest) -> None:
        rid = req.request_id
        if not rid or rid in self._tasks:
            why = "request_id: must be set" if not rid else f"request_id {rid!r} already running"
            self._emit(worker_pb2.SessionEvent(
                request_id=rid, error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                error_message=why))
            return
        self._tasks[rid] = asyncio.ensure_future(self._one(req))

    async def _one(self, req: worker_pb2.DecodeRequest) -> None:
        rid = req.request_id
        try:
            async for out in self._run(req):
                self._emit(worker_pb2.SessionEvent(request_id=rid, output=out))
        except asyncio.CancelledError:
            pass  # cancelled by the router (or the session ended): nobody waits for more
        except (ValueError, Unavailable, PermissionDenied) as e:
            code = (grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, ValueError)
                    else grpc.StatusCode.PERMISSION_DENIED if isinstance(e, PermissionDenied)
                    else grpc.StatusCode.UNAVAILABLE)
            self._emit(worker_pb2.SessionEvent(request_id=rid, error_code=code.value[0],
                                               error_message=str(e)))
        except Exception as e:
            log.exception("request %s failed", rid)
            self._emit(worker_pb2.SessionEvent(
                request_id=rid, error_code=grpc.StatusCode.INTERNAL.value[0],
                error_message=f"{type(e).__name__}: {e}"))
        finally:
            self._tasks.pop(rid, None)
            self._wake.set()

    def _emit(self, event: worker_pb2.SessionEvent) -> None:
        self._outbox.append(event)
        self._wake.set()
