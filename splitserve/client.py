"""`splitserve generate` and `splitserve chat`: stream completions from a router to the terminal.

A prompt goes out as text (a plain completion) or as chat messages, which the router renders
with the model's chat template (router/chat.py); either way the text streams to `out` as it
arrives and a one-line summary (finish reason, tokens, TTFT, end-to-end time) goes to stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

import grpc

from splitserve import finish
from splitserve.credentials import bearer
from splitserve.tls import TLSConfig, sync_channel
from splitserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

Turn = tuple[str, str]  # (role, content)


def build_request(prompt: str | Sequence[Turn], max_tokens: int, temperature: float,
                  seed: int | None = None) -> generation_pb2.GenerateRequest:
    """A text prompt, or a conversation (role, content) for the model's chat template."""
    sp = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    if seed is not None:
        sp.seed = seed
    if isinstance(prompt, str):
        return generation_pb2.GenerateRequest(text=prompt, sampling=sp)
    return generation_pb2.GenerateRequest(sampling=sp, messages=generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in prompt]))


def stream(stub: generation_pb2_grpc.GenerationStub, request: generation_pb2.GenerateRequest,
           timeout_s: float | None, api_key: str | None = None,
           out: TextIO = sys.stdout) -> str:
    """Write the answer to `out` as it streams, the summary to stderr; return the answer.
    Raises grpc.RpcError."""
    metadata = bearer(api_key) or None
    text, last = [], None
    for chunk in stub.Generate(request, timeout=timeout_s, metadata=metadata):
        out.write(chunk.text)
        out.flush()
        text.append(chunk.text)
        last = chunk
    out.write("\n")
    if last is not None and last.HasField("finish_reason"):
        t = last.timings
        # A KV hand-off (the decode worker's pull, up to its first step) happens only when a
        # prefill worker did the prompt: it is how a user sees the disaggregated path.
        split = (f"; disaggregated: prefill {t.prefill_s * 1e3:.0f} ms, KV hand-off "
                 f"{t.transfer_s * 1e3:.0f} ms" if t.transfer_s > 0 else "")
        reason = finish.to_word(last.finish_reason) or "unspecified"
        print(f"[{reason}; {last.usage.prompt_tokens} prompt + "
              f"{last.usage.completion_tokens} completion tokens; ttft {t.ttft_s * 1e3:.0f} ms, "
              f"e2e {t.e2e_s * 1e3:.0f} ms{split}]", file=sys.stderr, flush=True)
    return "".join(text)


def generate(router: str, prompt: str, max_tokens: int, temperature: float, seed: int | None,
             timeout_s: float | None, api_key: str | None = None,
             tls: TLSConfig | None = None, chat: bool = False) -> int:
    """One completion (`chat`: of `prompt` as the user's message); the exit status."""
    request = build_request([("user", prompt)] if chat else prompt, max_tokens, temperature,
                            seed)
    with sync_channel(router, tls) as ch:
        try:
            stream(generation_pb2_grpc.GenerationStub(ch), request, timeout_s, api_key)
        except grpc.RpcError as e:
            print(f"\nsplitserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
