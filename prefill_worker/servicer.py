"""PrefillWorker: runs a prompt to its first token on a producer engine and holds its KV.

Lifecycle of one request here: Prefill(prompt ids, transfer id) → vLLM with max_tokens=1 and
`produce_params(transfer_id)` → first token + the KV ticket back to the router, while the
connector holds the prompt's blocks under a lease until a decode worker pulls them — or the router
sends Release(transfer id) because it will not decode (stop string on the first token, client
gone, deadline, Decode failed), or the lease runs out.
The request never decodes here; if its first token already ends it (EOS), nothing is held.
"""

from __future__ import annotations

import time

import grpc

from splitserve import finish
from splitserve.engine import token_prompt
from splitserve.kv.control import kv_release
from splitserve.kv.ticket import KVTicket, produce_params, transfer_id_or_new
from splitserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.worker.convert import first_logprob, sampling_to_vllm
from splitserve.worker.core import WorkerCore, rpc_errors

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name


def add_to_server(core: WorkerCore, server: grpc.aio.Server) -> list[str]:
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(core), server)
    return [SERVICE]


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context) -> worker_pb2.PrefillResponse:
        t0 = time.perf_counter()
        async with rpc_errors(context, request.request_id):
            if not request.prompt_token_ids:
                raise ValueError("prompt_token_ids: must not be empty")
            with self.core.admit() as engine:
                # Hold the KV only when a decode worker will continue (the router says so by
                # asking for more than one token).
                wants_decode = (not request.sampling.HasField("max_tokens")
                                or request.sampling.max_tokens > 1)
                tid = transfer_id_or_new(request.transfer_id)
                params = sampling_to_vllm(
                    request.sampling, max_tokens=1, min_tokens=min(request.sampling.min_tokens, 1),
                    kv_transfer_params=produce_params(tid) if wants_decode else None)
                final = None
                prompt = token_prompt(list(request.prompt_token_ids))
                async for out in engine.generate(prompt, params, request_id=request.request_id):
                    final = out
                output = final.outputs[0]
                resp = worker_pb2.PrefillResponse(
                    first_token_id=output.token_ids[0],
                    num_prompt_tokens=len(request.prompt_token_ids),
                    timings=_timings(final.metrics, time.perf_counter() - t0))
                logprob = first_logprob(output)
                if logprob is not None:
                    resp.first_token_logprob = logprob
                if final.kv_transfer_params:
                    resp.ticket.CopyFrom(KVTicket.from_vllm(final.kv_transfer_params).to_proto())
                elif output.finish_reason != "length" or not wants_decode:
                    resp.finish_reason = finish.to_proto(output.finish_reason)
                return resp

    async def Release(self, request: worker_pb2.ReleaseRequest,
                      context) -> worker_pb2.ReleaseResponse:
        async with rpc_errors(context, request.transfer_id):
            if not request.transfer_id:
                raise ValueError("transfer_id: must not be empty")
            if self.core.engine is None:
                return worker_pb2.ReleaseResponse(state="unknown")  # nothing can be held yet
            state = await kv_release(self.core.engine, request.transfer_id)
            return worker_pb2.ReleaseResponse(state=state)

    async def Stats(self, request, context):
        return await self.core.stats(request, context)


def _timings(m, rpc_s: float) -> common_pb2.Timings:
    """Engine-side split of the prefill: waiting in vLLM's queue vs running. The planner needs
    the running part alone (it simulates queues itself); without vLLM's per-request stats the
    whole RPC counts as prefill."""
    if m is None or not (m.scheduled_ts and m.first_token_ts and m.queued_ts):
        return common_pb2.Timings(prefill_s=rpc_s)
    return common_pb2.Timings(queue_s=max(m.scheduled_ts - m.queued_ts, 0.0),
                              prefill_s=max(m.first_token_ts - m.scheduled_ts, 0.0))
