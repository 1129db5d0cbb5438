"""`splitserve generate`: stream one completion from a router to the terminal."""

from __future__ import annotations

import sys

import grpc

from splitserve.credentials import bearer
from splitserve.tls import TLSConfig, sync_channel
from splitserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

FINISH = {v.number: v.name.removeprefix("FINISH_REASON_").lower()
          for v in common_pb2.FinishReason.DESCRIPTOR.values}


def generate(router: str, prompt: str, max_tokens: int, temperature: float, seed: int | None,
             timeout_s: float | None, api_key: str | None = None,
             tls: TLSConfig | None = None) -> int:
    sp = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    if seed is not None:
        sp.seed = seed
    metadata = bearer(api_key) or None
    with sync_channel(router, tls) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        try:
            last = None
            for chunk in stub.Generate(generation_pb2.GenerateRequest(text=prompt, sampling=sp),
                                       timeout=timeout_s, metadata=metadata):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        except grpc.RpcError as e:
            print(f"\nsplitserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if last is not None and last.HasField("finish_reason"):
        t = last.timings
        print(f"[{FINISH[last.finish_reason]}; {last.usage.prompt_tokens} prompt + "
              f"{last.usage.completion_tokens} completion tokens; ttft {t.ttft_s * 1e3:.0f} ms, "
              f"e2e {t.e2e_s * 1e3:.0f} ms]", file=sys.stderr)
    return 0
