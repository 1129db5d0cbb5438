"""A stand-in decode worker that streams tokens as fast as it is asked: the router's load source.

A real engine on this kind of host makes a few hundred tokens a second, far too few to find what
the router itself can relay. This process serves the DecodeWorker service (and Stats, so a router
can list it as a static colocated worker) and answers every request with `max_tokens` token ids,
`--tokens-per-message` at a time, every `--step-s` seconds (0: as fast as the event loop
turns) — the shape of an engine's output, without the engine. Sessions batch what the requests
produce in one turn, as a real worker batches one engine step.

    python -m bench.token_source --port 0 --ready-file FILE [--step-s 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import grpc

from decode_worker.session import Session
from splitserve.roles import Role
from splitserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

VOCAB_START, VOCAB_SPAN = 100, 3000  # ids well inside the tiny model's vocabulary


class TokenSource(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, step_s: float, per_message: int, model: str) -> None:
        self.step_s, self.per_message, self.model = step_s, per_message, model

    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        async for chunk in self.run(request):
            yield chunk

    async def DecodeSession(self, request_iterator, context):
        async for batch in Session(self.run).serve(request_iterator):
            yield batch

    async def run(self, request: worker_pb2.DecodeRequest):
        n = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        # A request's stream interval raises the batch, and the first token goes alone, as vLLM.
        per_message = max(self.per_message, request.sampling.stream_interval)
        sent, seed = 0, len(request.prompt_token_ids)
        while sent < n:
            k = min(per_message if sent else 1, n - sent)
            chunk = worker_pb2.DecodeResponse(
                token_ids=[VOCAB_START + (seed + sent + i) % VOCAB_SPAN for i in range(k)])
            sent += k
            if sent == n:
                chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
            yield chunk
            await asyncio.sleep(self.step_s)  # 0: lets the other requests take their turn

    async def Stats(self, request, context):
        return worker_pb2.StatsResponse(role=Role.COLOCATED.to_proto(), model=self.model,
                                        load=common_pb2.WorkerLoad(total_kv_blocks=1 << 20,
                                                                   free_kv_blocks=1 << 20))


async def serve(a: argparse.Namespace) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
        TokenSource(a.step_s, a.tokens_per_message, a.model_name), server)
    port = server.add_insecure_port(f"127.0.0.1:{a.port}")
    await server.start()
    Path(a.ready_file).write_text(json.dumps({"grpc": f"127.0.0.1:{port}"}))
    await server.wait_for_termination()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--step-s", type=float, default=0.0, help="seconds between messages")
    ap.add_argument("--tokens-per-message", type=int, default=1)
    ap.add_argument("--model-name", default="tiny", help="the model name the router serves")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
