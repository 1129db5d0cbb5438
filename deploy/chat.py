"""`splitserve chat`: an interactive conversation with a router, streamed, with history.

Each line typed is a user turn. The whole conversation so far (after an optional system message)
goes to the router as chat messages, so the model reads the history through its own template;
the reply streams as it is generated and joins the history. When the router says the
conversation no longer fits the model's context, the oldest exchange is dropped and the turn
retried. `/reset` forgets the history; Ctrl-D, `/exit` or `/quit` ends the session.
"""

from __future__ import annotations

import sys

import grpc

from splitserve.client import Turn, build_request, stream
from splitserve.tls import TLSConfig, sync_channel
from splitserve.v1 import generation_pb2_grpc

COMMANDS = "/reset forgets the conversation, /exit (or Ctrl-D) ends it"


def run(router: str, system: str | None, max_tokens: int, temperature: float,
        seed: int | None, timeout_s: float, api_key: str | None,
        tls: TLSConfig | None = None) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"[splitserve] chatting with {router}; {COMMANDS}", file=sys.stderr)
    history: list[Turn] = []
    with sync_channel(router, tls) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while True:
            try:
                line = input("> " if interactive else "").strip()
            except EOFError:
                return 0
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                history.clear()
                continue
            if not line:
                continue
            history.append(("user", line))
            while True:
                head = [("system", system)] if system else []
                request = build_request(head + history, max_tokens, temperature, seed)
                try:
                    history.append(("assistant", stream(stub, request, timeout_s, api_key)))
                    break
                except grpc.RpcError as e:
                    too_long = (e.code() == grpc.StatusCode.INVALID_ARGUMENT
                                and "context length" in (e.details() or ""))
                    if too_long and len(history) > 2:
                        del history[:2]  # the oldest exchange; try again without it
                        continue
                    print(f"splitserve: {e.code().name}: {e.details()}", file=sys.stderr)
                    history.pop()  # the turn that failed is not part of the conversation
                    if not interactive:  # a script feeding us lines: stop at the first failure
                        return 1
                    break
