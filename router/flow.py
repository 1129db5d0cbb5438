"""One request through the workers, as a stream of token events.

Lifecycle: route → (disaggregated) Prefill on a prefill worker under a transfer id the router
chose → first token event at once (this is the TTFT) → Decode on a decode worker with prompt +
first token and the KV ticket → token events as the decode stream delivers them → final event
with finish reason and timings. (local) Decode with the prompt alone on a decode or colocated
worker.

A ticket is owed back to its prefill worker until a decode stream has consumed it (its first
message means the KV was pulled or given up on). Whatever ends the flow before that — a stop
string in the first token, the client leaving, the deadline, a failed Decode, a failed or
cancelled Prefill (which may still have held the KV) — sends Release(transfer id), so held KV is
freed at once instead of when its lease runs out. Closing the generator early also cancels the
decode RPC, which aborts the request on the decode worker and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from router.errors import RequestFailed, WorkerFailed
from router.ids import new_id
from router.registry import Worker
from router.session import Broken
from splitserve.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 5.0


@dataclass(slots=True)
class TokenEvent:
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: int | None = None  # common_pb2.FinishReason once the worker side is done


@dataclass
class FlowTimings:
    prefill_s: float = 0.0
    worker_queue_s: float = 0.0  # waiting in the prefill engine's own queue
    transfer_s: float = 0.0
    decode_s: float = 0.0
    first_token_at: float | None = None  # time.perf_counter() when the first token arrived


# A worker's status that the client gets as it is; anything else means "this worker failed".
_PASSTHROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
_STATUS = {c.value[0]: c for c in grpc.StatusCode}


def _failed(e: grpc.aio.AioRpcError, what: str, w: Worker) -> RequestFailed:
    msg = f"{what} on {w.role} worker {w.worker_id} failed: {e.code().name}: {e.details()}"
    if e.code() in _PASSTHROUGH:
        return RequestFailed(e.code(), msg)
    return WorkerFailed(w.worker_id, msg)


def _cut_off(what: str, w: Worker) -> RequestFailed:
    """The call was cancelled from our side of the channel (its worker was closed), not by the
    client: the worker failed, instead of the request ending without a status."""
    return WorkerFailed(w.worker_id,
                        f"{what} on {w.role} worker {w.worker_id} was cut off: channel closed")


def _we_are_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _left(deadline: float | None) -> float | None:
    """What remains of the request's deadline (time.monotonic()), for the next worker call."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


async def run_flow(request_id: str, prompt_ids: Sequence[int], sampling: common_pb2.SamplingParams,
                   prefill: Worker | None, decode: Worker, deadline: float | None,
                   timings: FlowTimings) -> AsyncIterator[TokenEvent]:
    # Clients may reuse a request id (or send two at once): what the workers see is made
    # unique here, so engine request ids, session ids and transfer ids never collide.
    request_id = f"{request_id}-{new_id()}"
    if prefill is None:
        async for ev in _decode(request_id, prompt_ids, sampling, None, decode, deadline,
                                timings):
            yield ev
        return

    transfer_id = request_id
    owed = True  # until we know the prefill held nothing, or a decode consumed the ticket
    try:
        resp = await _prefill(request_id, transfer_id, prompt_ids, sampling, prefill, deadline,
                              timings)
        owed = resp.HasField("ticket")
        done = resp.HasField("finish_reason") or sampling.max_tokens <= 1
        logprobs = [resp.first_token_logprob] if resp.HasField("first_token_logprob") else []
        yield TokenEvent([resp.first_token_id], logprobs,
                         (resp.finish_reason or common_pb2.FINISH_REASON_LENGTH) if done else None)
        if done:
            return
        ticket = resp.ticket if owed else None  # none: nothing held, the decode side prefills
        if ticket is not None and ticket.lease_expires_at < time.time():
            log.info("request %s: the KV lease of transfer %s ran out before Decode; the decode "
                     "worker prefills instead", request_id, transfer_id)
            ticket = None
        async for ev in _decode(request_id, prompt_ids, remaining(sampling, 1), ticket, decode,
                                deadline, timings, then=resp.first_token_id):
            owed = False  # the decode side has pulled (or given up on) the KV
            yield ev
    finally:
        if owed:
            _release_soon(prefill, transfer_id)


async def _prefill(request_id: str, transfer_id: str, prompt_ids: Sequence[int],
                   sampling: common_pb2.SamplingParams, w: Worker, deadline: float | None,
                   timings: FlowTimings) -> worker_pb2.PrefillResponse:
    req = worker_pb2.PrefillRequest(request_id=f"{request_id}-p", prompt_token_ids=prompt_ids,
                                    sampling=sampling, transfer_id=transfer_id)
    t0 = time.perf_counter()
    w.inflight += 1
    w.inflight_tokens += len(prompt_ids)
    try:
        resp = await w.stub.Prefill(req, timeout=_left(deadline))
    except grpc.aio.AioRpcError as e:
        raise _failed(e, "prefill", w) from e
    except grpc.aio.UsageError as e:
        raise _cut_off("prefill", w) from e
    except asyncio.CancelledError:
        if _we_are_cancelled():
            raise
        raise _cut_off("prefill", w) from None
    finally:
        w.inflight -= 1
        w.inflight_tokens -= len(prompt_ids)
    # The worker splits its time into engine queue and prefill compute when it can.
    timings.prefill_s = resp.timings.prefill_s or (time.perf_counter() - t0)
    timings.worker_queue_s = resp.timings.queue_s
    timings.first_token_at = time.perf_counter()
    return resp


async def _decode(request_id: str, prompt_ids: Sequence[int],
                  sampling: common_pb2.SamplingParams, ticket: common_pb2.KvTicket | None,
                  w: Worker, deadline: float | None, timings: FlowTimings,
                  then: int | None = None) -> AsyncIterator[TokenEvent]:
    """The decode worker's events for this request, over the worker's shared session. Events
    that are already waiting are merged into one: the client gets one message for them (the
    session drops a request's inbox at its last event, so a finish is always the last).
    `then`: the prefill worker's first token, which the decode side continues from."""
    rid = f"{request_id}-d"
    req = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                   sampling=sampling)
    if then is not None:  # appended to the message, not to a copy of the prompt
        req.prompt_token_ids.append(then)
    if ticket is not None:
        req.ticket.CopyFrom(ticket)
    assert w.session is not None, "decode-capable workers have a session"
    w.inflight += 1
    done = False
    try:
        async with asyncio.timeout(_left(deadline)):
            inbox = w.session.start(req)
            while not done:
                tokens: list[int] = []
                logprobs: list[float] = []
                for ev in await inbox.take():
                    if isinstance(ev, Broken) or ev.error_code:
                        if tokens:  # what arrived before the failure still reaches the client
                            yield TokenEvent(tokens, logprobs)
                        raise _failure(ev, w)
                    tokens += ev.output.token_ids
                    logprobs += ev.output.logprobs
                out = ev.output
                if tokens and timings.first_token_at is None:
                    timings.first_token_at = time.perf_counter()
                finish = out.finish_reason if out.HasField("finish_reason") else None
                if finish is not None:
                    done = True
                    timings.transfer_s = out.timings.transfer_s
                    timings.prefill_s += out.timings.prefill_s
                    timings.decode_s = out.timings.decode_s
                yield TokenEvent(tokens, logprobs, finish)
    except TimeoutError:
        raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"deadline passed while decoding on {w.worker_id}") from None
    finally:
        w.inflight -= 1
        if not done:
            w.session.cancel_soon(rid)  # aborts the worker's request when we stop early


def _failure(ev: worker_pb2.SessionEvent | Broken, w: Worker) -> RequestFailed:
    """What a broken session or a worker's error event means for the request."""
    if isinstance(ev, Broken):
        return WorkerFailed(w.worker_id, f"decode on {w.role} worker {w.worker_id} failed: "
                                         f"{ev.message}")
    code = _STATUS.get(ev.error_code, grpc.StatusCode.UNAVAILABLE)
    msg = f"decode on {w.role} worker {w.worker_id} failed: {code.name}: {ev.error_message}"
    return RequestFailed(code, msg) if code in _PASSTHROUGH else WorkerFailed(w.worker_id, msg)


def remaining(sp: common_pb2.SamplingParams, done: int) -> common_pb2.SamplingParams:
    """What is left to generate once `done` tokens are out: after the prefill worker's first
    token (decode side), or after a failed worker's tokens (migration)."""
    rest = common_pb2.SamplingParams()
    rest.CopyFrom(sp)
    rest.max_tokens = sp.max_tokens - done
    rest.min_tokens = max(sp.min_tokens - done, 0)
    return rest


# Releases outlive the request that owed them (it may be unwinding from a cancellation), so
# they run as tasks of their own; the set keeps them referenced until they finish.
_releases: set[asyncio.Task] = set()


def _release_soon(w: Worker, transfer_id: str) -> None:
    async def release() -> None:
        try:
            resp = await w.stub.Release(worker_pb2.ReleaseRequest(transfer_id=transfer_id),
                                        timeout=RELEASE_TIMEOUT_S)
            log.debug("released transfer %s on %s (was %s)", transfer_id, w.worker_id,
                      resp.state)
        except grpc.aio.AioRpcError as e:
            log.info("release of transfer %s on %s failed (%s); its lease will free it",
                     transfer_id, w.worker_id, e.code().name)

    task = asyncio.ensure_future(release())
    _releases.add(task)
    task.add_done_callback(_releases.discard)
