"""Decode sessions: many requests over one gRPC stream, both halves, over real gRPC.

The worker half (decode_worker/session.py) runs behind a real gRPC server here, with a stand-in
for the engine: a generator of token messages (what the session multiplexes is independent of
where the tokens come from; the e2e suite runs it on real engines).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_worker.session import Session
from router.session import Broken, DecodeSession, Inbox
from splitserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.worker.errors import Unavailable


class Engine(worker_pb2_grpc.DecodeWorkerServicer):
    """Tokens 0..n-1 for a request asking n, one per engine step (every request advances on the
    same 1 ms tick, as in a batch); prompt [1] fails as bad input, [2] as unavailable, [3] never
    finishes. Counts the batches the session sent and the requests it cancelled."""

    def __init__(self) -> None:
        self.batches = 0
        self.cancelled: list[str] = []
        self._step = asyncio.Event()
        self._ticker = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            step, self._step = self._step, asyncio.Event()
            step.set()

    async def run(self, req: worker_pb2.DecodeRequest):
        if list(req.prompt_token_ids) == [1]:
            raise ValueError("prompt_token_ids: bad")
        if list(req.prompt_token_ids) == [2]:
            raise Unavailable("worker is draining")
        n = req.sampling.max_tokens
        endless = list(req.prompt_token_ids) == [3]
        i = 0
        try:
            while endless or i < n:
                out = worker_pb2.DecodeResponse(token_ids=[i])
                i += 1
                if i == n and not endless:  # (it once did finish: a test racing the ticks)
                    out.finish_reason = common_pb2.FINISH_REASON_LENGTH
                yield out
                await self._step.wait()
        except asyncio.CancelledError:
            self.cancelled.append(req.request_id)
            raise

    async def DecodeSession(self, request_iterator, context):
        async for batch in Session(self.run).serve(request_iterator):
            self.batches += 1
            yield batch


def req(rid: str, n: int = 5, prompt: tuple[int, ...] = (9,)) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                    sampling=common_pb2.SamplingParams(max_tokens=n))


async def collect(q: Inbox) -> list:
    """Events of one request up to its finish, error or break."""
    out = []
    while True:
        ev = await asyncio.wait_for(q.get(), 10)
        out.append(ev)
        if isinstance(ev, Broken) or ev.error_code or ev.output.HasField("finish_reason"):
            return out


def run(test) -> None:
    async def main() -> None:
        engine = Engine()
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(engine, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        session = DecodeSession(worker_pb2_grpc.DecodeWorkerStub(channel), "w")
        try:
            await test(engine, session, server)
        finally:
            engine._ticker.cancel()
            await session.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(main())


def test_concurrent_requests_share_one_stream_in_batches() -> None:
    async def test(engine, session, server) -> None:
        queues = [session.start(req(f"r{i}", n=20)) for i in range(16)]
        results = await asyncio.gather(*(collect(q) for q in queues))
        for events in results:
            tokens = [t for ev in events for t in ev.output.token_ids]
            assert tokens == list(range(20))  # each its own tokens, in order
        # 16 x 20 token messages, far fewer batches: requests' steps travel together.
        assert engine.batches < 16 * 20 / 4

    run(test)


def test_a_finished_request_leaves_nothing_behind() -> None:
    async def test(engine, session, server) -> None:
        for _ in range(3):  # the same id again: allowed once the previous one finished
            assert len(await collect(session.start(req("again", n=3)))) >= 1
        bad = session.start(req("bad", prompt=(1,)))
        assert (await collect(bad))[-1].error_code
        assert session._queues == {}

    run(test)


def test_cancel_stops_one_request_on_the_worker() -> None:
    async def test(engine, session, server) -> None:
        endless = session.start(req("endless", prompt=(3,)))
        normal = session.start(req("normal", n=50))
        await endless.get()
        session.cancel_soon("endless")
        events = await collect(normal)
        assert [t for ev in events for t in ev.output.token_ids] == list(range(50))
        for _ in range(100):
            if engine.cancelled:
                break
            await asyncio.sleep(0.01)
        assert engine.cancelled == ["endless"]

    run(test)


@pytest.mark.parametrize(("prompt", "code"), [((1,), grpc.StatusCode.INVALID_ARGUMENT),
                                              ((2,), grpc.StatusCode.UNAVAILABLE)])
def test_a_failed_request_gets_its_status_and_others_go_on(prompt, code) -> None:
    async def test(engine, session, server) -> None:
        bad = session.start(req("bad", prompt=prompt))
        good = session.start(req("good", n=10))
        (ev,) = await collect(bad)
        assert ev.error_code == code.value[0] and ev.error_message
        assert len(await collect(good)) >= 1

    run(test)


def test_a_request_id_twice_is_refused_by_both_sides() -> None:
    async def test(engine, session, server) -> None:
        session.start(req("same", prompt=(3,)))
        with pytest.raises(ValueError, match="already"):
            session.start(req("same", n=3))
        # A caller that is not our router: the worker refuses the second one itself.
        call = session._stub.DecodeSession()
        await call.write(worker_pb2.SessionRequest(start=req("twin", prompt=(3,))))
        await call.write(worker_pb2.SessionRequest(start=req("twin", n=3)))
        while True:
            batch = await asyncio.wait_for(call.read(), 10)
            refused = [ev for ev in batch.events if ev.error_code]
            if refused:
                break
        assert refused[0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "already running" in refused[0].error_message
        call.cancel()

    run(test)


def test_a_broken_stream_fails_every_request_on_it() -> None:
    async def test(engine, session, server) -> None:
        queues = [session.start(req(f"r{i}", prompt=(3,))) for i in range(4)]
        for q in queues:
            await q.get()
        await server.stop(0)  # the worker goes away mid-stream
        for q in queues:
            ev = (await collect(q))[-1]
            assert isinstance(ev, Broken) and ev.code == grpc.StatusCode.UNAVAILABLE
        late = session.start(req("late"))  # a new stream is tried, and fails cleanly
        assert isinstance((await collect(late))[-1], Broken)

    run(test)


def test_a_stream_that_cannot_be_written_fails_its_requests_instead_of_hanging() -> None:
    async def test(engine, session, server) -> None:
        assert not isinstance((await collect(session.start(req("first", n=3))))[-1], Broken)
        endless = session.start(req("endless", prompt=(3,)))
        await endless.get()  # running on the worker when the stream goes bad

        async def refused(msg) -> None:
            raise RuntimeError("the transport refused the message")

        session._call.write = refused  # the stream's next write fails
        unsent = session.start(req("unsent", n=3))
        for q in (unsent, endless):  # both fail over (and would migrate), neither waits on
            assert isinstance((await collect(q))[-1], Broken)
        # The next request opens a fresh stream and is served.
        assert not isinstance((await collect(session.start(req("after", n=3))))[-1], Broken)

    run(test)
