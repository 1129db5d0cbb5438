"""router/flow.py with stand-in workers: when the Decode goes out, and what an early end undoes.
The real workers: tests/e2e (the golden and release tests)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from router.flow import FlowTimings, run_flow
from router.session import Inbox
from splitserve.v1 import common_pb2, worker_pb2

FIRST = 42


class _Session:
    """The decode worker's shared session: records starts and cancels; streams two tokens."""

    def __init__(self) -> None:
        self.started: list[worker_pb2.DecodeRequest] = []
        self.cancelled: list[str] = []

    def start(self, req: worker_pb2.DecodeRequest) -> Inbox:
        self.started.append(req)
        inbox = Inbox()
        for tok, last in ((43, False), (44, True)):
            out = worker_pb2.DecodeResponse(token_ids=[tok])
            if last:
                out.finish_reason = common_pb2.FINISH_REASON_LENGTH
            inbox.put(worker_pb2.SessionEvent(request_id=req.request_id, output=out))
        return inbox

    def cancel_soon(self, rid: str) -> None:
        self.cancelled.append(rid)


class _PrefillStub:
    def __init__(self) -> None:
        self.released: list[str] = []

    async def Prefill(self, req, timeout=None):  # noqa: N802 (gRPC's spelling)
        ticket = common_pb2.KvTicket(transfer_id=req.transfer_id,
                                     lease_expires_at=time.time() + 30)
        return worker_pb2.PrefillResponse(first_token_id=FIRST, ticket=ticket)

    async def Release(self, req, timeout=None):  # noqa: N802
        self.released.append(req.transfer_id)
        return worker_pb2.ReleaseResponse(state="held")


def _workers():
    prefill = SimpleNamespace(worker_id="p0", role="prefill", stub=_PrefillStub(), inflight=0,
                              inflight_tokens=0)
    decode = SimpleNamespace(worker_id="d0", role="decode", session=_Session(), inflight=0)
    return prefill, decode


def _flow(prefill, decode):
    return run_flow("r1", [1, 2, 3], common_pb2.SamplingParams(max_tokens=3), prefill, decode,
                    None, FlowTimings())


def test_the_decode_goes_out_before_the_first_token_is_relayed() -> None:
    """The flow's consumer relays the first token to the client before it asks for the next
    event; the hand-off to the decode worker must not wait for that."""
    async def main():
        prefill, decode = _workers()
        flow = _flow(prefill, decode)
        first = await anext(flow)
        assert first.token_ids == [FIRST] and first.finish_reason is None
        (req,) = decode.session.started  # sent before we asked for anything more
        assert list(req.prompt_token_ids) == [1, 2, 3, FIRST] and req.HasField("ticket")
        assert req.sampling.max_tokens == 2
        rest = [ev async for ev in flow]
        assert [t for ev in rest for t in ev.token_ids] == [43, 44]
        await asyncio.sleep(0)
        assert decode.session.cancelled == [] and prefill.stub.released == []
        assert decode.inflight == 0 and prefill.inflight == 0

    asyncio.run(main())


def test_a_flow_ended_after_the_first_token_cancels_its_decode_and_releases_the_kv() -> None:
    """A stop string in the first token (or the client leaving) ends the flow there: the decode
    already sent is cancelled on the worker, and the held KV released."""
    async def main():
        prefill, decode = _workers()
        flow = _flow(prefill, decode)
        await anext(flow)
        await flow.aclose()
        await asyncio.sleep(0.01)  # the release runs as a task of its own
        (req,) = decode.session.started
        assert decode.session.cancelled == [req.request_id]
        assert prefill.stub.released == [req.ticket.transfer_id]
        assert decode.inflight == 0

    asyncio.run(main())
