"""Send a workload to a router and record what each request saw, over gRPC or OpenAI HTTP.

Lifecycle of one run: requests are released at their arrival offsets (open loop) or whenever
one of `concurrency` slots frees up (closed loop); each streams its tokens, and the time of every
chunk is recorded (`RequestResult`), with the server's own timing breakdown when the protocol
carries it (gRPC). A failed request is recorded as failed, never dropped. Output lengths are
controlled with `ignore_eos` so every request generates what the workload asked for.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Sequence

import grpc
import httpx
from tqdm import tqdm

from bench.metrics import RequestResult
from bench.workload import RequestSpec
from splitserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc


class GrpcTarget:
    def __init__(self, address: str, model: str = "", timeout_s: float = 600.0,
                 detokenize: bool = False, stream_interval: int = 1) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.model, self.timeout_s, self.detokenize = model, timeout_s, detokenize
        self.stream_interval = stream_interval  # 1: ask nothing (the router's own applies)

    async def send(self, spec: RequestSpec) -> RequestResult:
        sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=spec.output_len,
                                       min_tokens=spec.output_len, ignore_eos=True)
        req = generation_pb2.GenerateRequest(model=self.model, sampling=sp,
                                             skip_detokenize=not self.detokenize)
        if self.stream_interval > 1:
            req.sampling.stream_interval = self.stream_interval
        if spec.prompt_ids is not None:
            req.token_ids.ids.extend(spec.prompt_ids)
        else:
            req.text = spec.prompt_text or ""
        r = RequestResult(ok=False, start=time.perf_counter(), chunk_times=[], chunk_tokens=[],
                          end=0.0, prompt_tokens=max(spec.prompt_len, 0), output_tokens=0,
                          server={})
        try:
            async for chunk in self.stub.Generate(req, timeout=self.timeout_s):
                if chunk.token_ids:
                    r.chunk_times.append(time.perf_counter())
                    r.chunk_tokens.append(len(chunk.token_ids))
                if chunk.HasField("finish_reason"):
                    t = chunk.timings
                    r.server = {"queue_s": t.queue_s, "prefill_s": t.prefill_s,
                                "transfer_s": t.transfer_s, "decode_s": t.decode_s}
                    r.prompt_tokens = chunk.usage.prompt_tokens
            r.ok = True
        except grpc.aio.AioRpcError as e:
            r.error = f"{e.code().name}: {e.details()}"
        r.end = time.perf_counter()
        r.output_tokens = sum(r.chunk_tokens)
        return r

    async def close(self) -> None:
        await self.channel.close()


class HttpTarget:
    """POST /v1/completions with stream=true; SSE chunks are timed as they arrive."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0,
                 api_key: str | None = None, stream_interval: int = 1) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        # TCP_NODELAY: httpx writes a POST's headers and body separately, and with Nagle on the
        # body waits for the server's delayed ACK: 40 ms added to every measured TTFT.
        transport = httpx.AsyncHTTPTransport(
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            limits=httpx.Limits(max_connections=1024))
        self.client = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                        headers=headers, transport=transport)
        self.model, self.stream_interval = model, stream_interval

    async def send(self, spec: RequestSpec) -> RequestResult:
        body = {"model": self.model, "max_tokens": spec.output_len, "min_tokens": spec.output_len,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
                "prompt": list(spec.prompt_ids) if spec.prompt_ids is not None
                else spec.prompt_text}
        if self.stream_interval > 1:
            body["stream_interval"] = self.stream_interval
        r = RequestResult(ok=False, start=time.perf_counter(), chunk_times=[], chunk_tokens=[],
                          end=0.0, prompt_tokens=max(spec.prompt_len, 0), output_tokens=0,
                          server={})
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                else:
                    await self._read(resp, r)
        except httpx.HTTPError as e:
            r.error = f"{type(e).__name__}: {e}"
        r.end = time.perf_counter()
        return r

    @staticmethod
    async def _read(resp: httpx.Response, r: RequestResult) -> None:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                r.error = str(event["error"])
                return
            if event.get("usage"):
                r.prompt_tokens = event["usage"]["prompt_tokens"]
                r.output_tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text"):
                r.chunk_times.append(time.perf_counter())
                r.chunk_tokens.append(1)  # SSE does not say; usage fixes the total below
        if r.chunk_tokens and r.output_tokens:
            r.chunk_tokens[-1] += r.output_tokens - sum(r.chunk_tokens)
        r.ok = True

    async def close(self) -> None:
        await self.client.aclose()


async def run_load(target, specs: Sequence[RequestSpec], arrivals: Sequence[float] | None,
                   concurrency: int | None = None, progress: bool = True
                   ) -> tuple[list[RequestResult], float]:
    """Send every spec; returns results in spec order and the wall duration of the run."""
    bar = tqdm(total=len(specs), desc="requests", unit="req", disable=not progress,
               leave=False)
    results: list[RequestResult | None] = [None] * len(specs)
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        if arrivals is not None:
            await asyncio.sleep(max(t0 + arrivals[i] - time.perf_counter(), 0.0))
        if slots is not None:
            async with slots:
                results[i] = await target.send(specs[i])
        else:
            results[i] = await target.send(specs[i])
        bar.update(1)

    await asyncio.gather(*(one(i) for i in range(len(specs))))
    bar.close()
    return [r for r in results if r is not None], time.perf_counter() - t0
