"""DecodeWorker: continues a request from pulled KV (or prefills it itself) and streams tokens.

Lifecycle of one request here: Decode(prompt ids + first token, KV ticket) → the consumer
connector pulls the prompt's KV from the prefill worker named by the ticket while the request
waits (WAITING_FOR_REMOTE_KVS) → vLLM computes only the new token's KV and decodes → token deltas
stream back until a finish reason. Without a ticket the worker prefills locally: that is the
colocated role, and the router's choice for prompts too short to be worth a transfer.
The router sends its requests over one DecodeSession (session.py: per engine step, one batch for
all of them); Decode serves a single request, for direct callers.
A ticket must carry a router's voucher when this worker has the cluster credential
(router/vouch.py): otherwise whoever could call us could make the engine dial any address.
A cancelled request (a session's cancel, or a cancelled Decode call: client gone, deadline, stop
string) aborts the vLLM request, freeing its blocks (and, if it had not pulled yet, telling the
producer to release its copy).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from decode_worker.session import Session
from splitserve import finish
from splitserve.engine import token_prompt
from splitserve.kv.ticket import KVTicket
from splitserve.roles import Role
from splitserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.worker.convert import sampling_to_vllm
from splitserve.worker.core import WorkerCore, rpc_errors
from splitserve.worker.errors import PermissionDenied

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


def add_to_server(core: WorkerCore, server: grpc.aio.Server) -> list[str]:
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(core), server)
    return [SERVICE]


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        async with rpc_errors(context, request.request_id):
            async for chunk in self.run(request):
                yield chunk

    async def DecodeSession(self, request_iterator, context):
        async for batch in Session(self.run).serve(request_iterator):
            yield batch

    async def run(self, request: worker_pb2.DecodeRequest
                  ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """One request's outputs; ValueError for bad input, Unavailable when not serving."""
        t0 = time.perf_counter()
        if not request.prompt_token_ids:
            raise ValueError("prompt_token_ids: must not be empty")
        ticket = KVTicket.from_proto(request.ticket) if request.HasField("ticket") else None
        if ticket is not None and self.core.cfg.role is not Role.DECODE:
            raise ValueError(f"ticket: this worker cannot pull KV (role {self.core.cfg.role})")
        key = self.core.ticket_key
        if ticket is not None and key is not None and not ticket.vouched_by(key):
            # Before the engine sees it: an unvouched ticket could name any host:port to dial.
            raise PermissionDenied(f"ticket {ticket.transfer_id}: not vouched for by a router "
                                   f"of this cluster (docs/security.md)")
        with self.core.admit() as engine:
            if self.core.faults.stall_decode_s:
                await asyncio.sleep(self.core.faults.stall_decode_s)
            params = sampling_to_vllm(
                request.sampling, kv_transfer_params=ticket.to_vllm() if ticket else None)
            t_first = None
            prompt = token_prompt(list(request.prompt_token_ids))
            async for out in engine.generate(prompt, params, request_id=request.request_id):
                output = out.outputs[0]
                if t_first is None and output.token_ids:
                    t_first = time.perf_counter()
                chunk = worker_pb2.DecodeResponse(token_ids=output.token_ids)
                if output.logprobs:
                    chunk.logprobs.extend(float(lp[t].logprob) for t, lp in
                                          zip(output.token_ids, output.logprobs))
                if output.finish_reason is not None:
                    chunk.finish_reason = finish.to_proto(output.finish_reason)
                    now = time.perf_counter()
                    first = t_first or now
                    # With pulled KV, the wait before the first token is the transfer (plus
                    # one decode step); without, it is the local prefill.
                    chunk.timings.CopyFrom(common_pb2.Timings(
                        transfer_s=(first - t0) if ticket else 0.0,
                        prefill_s=0.0 if ticket else (first - t0),
                        decode_s=now - first, e2e_s=now - t0))
                yield chunk

    async def Stats(self, request, context):
        return await self.core.stats(request, context)
