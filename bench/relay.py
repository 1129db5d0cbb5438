"""The least a router can be: a Generation front that relays token-id requests to one worker.

What the router cannot do without and nothing else: take the client's call, start the request
on the worker's decode session (router/session.py, the router's own), and write each batch of
token ids back. No validation, admission, routing, detokenisation, metrics or deadlines. Its
time to first token over going straight to the worker is the price of the extra hop alone, the
floor under the router's (`bench/router_hop.py`).

    python -m bench.relay --worker ADDRESS --ready-file FILE [--port 0]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import grpc

from deploy.loop import run
from router.session import Broken, DecodeSession
from splitserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc


class Relay(generation_pb2_grpc.GenerationServicer):
    def __init__(self, session: DecodeSession) -> None:
        self.session = session
        self.ids = itertools.count()

    async def Generate(self, request: generation_pb2.GenerateRequest, context) -> None:
        rid = f"relay-{next(self.ids)}"
        inbox = self.session.start(worker_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=request.token_ids.ids, sampling=request.sampling))
        while True:
            events = await inbox.take()
            last = events[-1]  # a failure or a finish is always the last
            if isinstance(last, Broken) or last.error_code:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker failed: {last}")
            ids = [t for ev in events for t in ev.output.token_ids]
            await context.write(generation_pb2.GenerateResponse(request_id=rid, token_ids=ids))
            if last.output.HasField("finish_reason"):
                return


async def serve(a: argparse.Namespace) -> None:
    channel = grpc.aio.insecure_channel(a.worker)
    session = DecodeSession(worker_pb2_grpc.DecodeWorkerStub(channel), a.worker)
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(Relay(session), server)
    port = server.add_insecure_port(f"127.0.0.1:{a.port}")
    await server.start()
    Path(a.ready_file).write_text(json.dumps({"grpc": f"127.0.0.1:{port}"}))
    try:
        await server.wait_for_termination()
    finally:
        await session.close()
        await channel.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", required=True, help="the decode worker's gRPC address")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ready-file", required=True)
    run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
