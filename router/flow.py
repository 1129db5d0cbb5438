"""One request through the workers, as a stream of token events.

Lifecycle: route → (disaggregated) Prefill on a prefill worker → first token event at once (this
is the TTFT) → Decode on a decode worker with prompt + first token and the KV transfer params →
token events as the decode stream delivers them → final event with finish reason and timings.
(local) Decode with the prompt alone on a decode or colocated worker.
Closing the generator early (stop string, client gone, deadline) cancels the decode RPC, which
aborts the request on the worker and frees its blocks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from router.registry import Worker
from splitserve.v1 import common_pb2, worker_pb2


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


class WorkerFailed(Exception):
    """A worker RPC failed; carries the status to return to the client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _failed(e: grpc.aio.AioRpcError, what: str, w: Worker) -> WorkerFailed:
    passthrough = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                   grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    code = e.code() if e.code() in passthrough else grpc.StatusCode.UNAVAILABLE
    return WorkerFailed(code, f"{what} on {w.role} worker {w.worker_id} failed: "
                              f"{e.code().name}: {e.details()}")


async def run_flow(request_id: str, prompt_ids: list[int], sampling: common_pb2.SamplingParams,
                   prefill: Worker | None, decode: Worker, timeout: float | None,
                   timings: FlowTimings) -> AsyncIterator[TokenEvent]:
    max_tokens = sampling.max_tokens
    kv = None
    if prefill is not None:
        req = worker_pb2.PrefillRequest(request_id=f"{request_id}-p", prompt_token_ids=prompt_ids,
                                        sampling=sampling)
        t0 = time.perf_counter()
        prefill.inflight += 1
        try:
            resp = await prefill.stub.Prefill(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _failed(e, "prefill", prefill) from e
        finally:
            prefill.inflight -= 1
        # The worker splits its time into engine queue and prefill compute when it can.
        rpc_s = time.perf_counter() - t0
        timings.prefill_s = resp.timings.prefill_s or rpc_s
        timings.worker_queue_s = resp.timings.queue_s
        timings.first_token_at = time.perf_counter()
        done = resp.HasField("finish_reason") or max_tokens <= 1
        logprobs = [resp.first_token_logprob] if resp.HasField("first_token_logprob") else []
        yield TokenEvent([resp.first_token_id], logprobs,
                         (resp.finish_reason or common_pb2.FINISH_REASON_LENGTH) if done else None)
        if done:
            return
        prompt_ids = [*prompt_ids, resp.first_token_id]
        sampling = _rest_after_first(sampling)
        if resp.HasField("kv_transfer_params"):
            kv = resp.kv_transfer_params
        # else: the producer held nothing (e.g. no full computation); decode prefills locally.

    dreq = worker_pb2.DecodeRequest(request_id=f"{request_id}-d", prompt_token_ids=prompt_ids,
                                    sampling=sampling)
    if kv is not None:
        dreq.kv_transfer_params.CopyFrom(kv)
    decode.inflight += 1
    call = decode.stub.Decode(dreq, timeout=timeout)
    try:
        async for chunk in call:
            if chunk.token_ids and timings.first_token_at is None:
                timings.first_token_at = time.perf_counter()
            finish = chunk.finish_reason if chunk.HasField("finish_reason") else None
            if finish is not None:
                timings.transfer_s = chunk.timings.transfer_s
                timings.prefill_s += chunk.timings.prefill_s
                timings.decode_s = chunk.timings.decode_s
            yield TokenEvent(list(chunk.token_ids), list(chunk.logprobs), finish)
    except grpc.aio.AioRpcError as e:
        raise _failed(e, "decode", decode) from e
    finally:
        decode.inflight -= 1
        call.cancel()  # no-op when finished; aborts the worker's request when we stop early


def _rest_after_first(sp: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    """The decode worker generates what is left after the prefill worker's first token."""
    rest = common_pb2.SamplingParams()
    rest.CopyFrom(sp)
    rest.max_tokens = sp.max_tokens - 1
    rest.min_tokens = max(sp.min_tokens - 1, 0)
    return rest
