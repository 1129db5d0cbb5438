"""OpenAI-compatible HTTP front of the router (FastAPI), on the same event loop as gRPC.

A request here becomes the same `GenerateRequest` the gRPC service takes and runs through the same
`GenerationService.stream`: identical validation, routing, detokenisation and metrics. Errors are
OpenAI error objects with 400 / 401 / 404 / 429 / 503 / 504. A client that disconnects cancels
the stream, which cancels the worker RPCs (both workers abort the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio._backends._asyncio  # noqa: F401  (anyio loads it lazily: on the first request's TTFT)
import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from router.errors import InvalidArgument, RequestFailed
from router.generation import GenerationService
from splitserve.v1 import common_pb2, generation_pb2

FINISH = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop",
          common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_ERROR: "error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": str(self), "type": self.kind, "param": self.param, "code": self.code}})


def build_app(service: GenerationService, registry: CollectorRegistry,
              api_key: str | None = None) -> FastAPI:
    # A dependency of the /v1 routes, not an HTTP middleware: Starlette's BaseHTTPMiddleware
    # relays a streaming body through a memory channel, which cost every request ~60 ms of TTFT.
    async def auth(request: Request) -> None:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "invalid or missing API key", kind="authentication_error",
                           code="invalid_api_key")

    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth)])
    template = service.tokenizer.chat_template
    chat = (jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)
            if template else None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.get("/health")
    async def health():
        try:
            service.route(1, local=False)
        except RequestFailed as e:
            return JSONResponse(status_code=503, content={"status": "unavailable",
                                                          "detail": str(e)})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": service.served_model, "object": "model",
                                            "created": 0, "owned_by": "splitserve",
                                            "max_model_len": service.cfg.max_model_len}]}

    @v1.post("/completions")
    async def completions(request: Request):
        body = await _json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            req = generation_pb2.GenerateRequest(text=prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt))
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")
        return await _run(service, req, body, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                for m in messages):
            raise ApiError(400, "messages must be a non-empty list of {role, content}",
                           "messages")
        if chat is None:
            raise ApiError(400, "this model has no chat template", "messages")
        text = chat.render(messages=messages, add_generation_prompt=True,
                           bos_token=service.tokenizer.bos_token or "",
                           eos_token=service.tokenizer.eos_token or "")
        ids = service.tokenizer.encode(text, add_special_tokens=False)
        req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids))
        return await _run(service, req, body, chat=True)

    app.include_router(v1)
    return app


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _sampling(body: dict[str, Any], req: generation_pb2.GenerateRequest) -> None:
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    sp = req.sampling
    try:
        for key in ("temperature", "top_p", "top_k", "max_tokens", "seed", "min_tokens"):
            value = body.get("max_completion_tokens") if key == "max_tokens" and body.get(
                "max_tokens") is None else body.get(key)
            if value is not None:
                setattr(sp, key, value)
        stop = body.get("stop")
        sp.stop.extend([stop] if isinstance(stop, str) else (stop or []))
        sp.ignore_eos = bool(body.get("ignore_eos", False))
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"bad sampling parameter: {e}") from e
    if body.get("model"):
        req.model = str(body["model"])


async def _run(service: GenerationService, req: generation_pb2.GenerateRequest,
               body: dict[str, Any], chat: bool):
    _sampling(body, req)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    req.request_id = rid
    timeout = body.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not 0 < timeout < float("inf")):
        raise ApiError(400, f"timeout must be a positive number of seconds, got {timeout!r}",
                       "timeout")
    trace = service.metrics.trace()
    chunks = _guard(service.stream(req, timeout, trace), trace)
    first = await _first(chunks)  # errors before the first chunk become HTTP statuses
    created = int(time.time())
    if body.get("stream"):
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_sse(first, chunks, rid, created, service.served_model, chat,
                                      usage), media_type="text/event-stream")
    text, last = first.text, first
    async for c in chunks:
        text += c.text
        last = c
    choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH.get(last.finish_reason),
                              "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if last.HasField("stop_reason"):
        choice["stop_reason"] = last.stop_reason
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": service.served_model, "choices": [choice],
            "usage": _usage(last)}


def _usage(c: generation_pb2.GenerateResponse) -> dict[str, int]:
    p, n = c.usage.prompt_tokens, c.usage.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


async def _guard(chunks: AsyncIterator, trace) -> AsyncIterator:
    try:
        async with contextlib.aclosing(chunks):  # closed now, not whenever it is collected
            async for c in chunks:
                yield c
    except InvalidArgument as e:
        trace.finish(e.outcome)
        status = 404 if e.field == "model" else 400
        # OpenAI names request fields flat ("temperature", not "sampling.temperature").
        raise ApiError(status, str(e), e.field.removeprefix("sampling."),
                       code="model_not_found" if status == 404 else None) from e
    except RequestFailed as e:
        trace.finish(e.outcome)
        raise ApiError(e.http_status, str(e), kind="invalid_request_error"
                       if e.http_status == 400 else "server_error") from e
    except (asyncio.CancelledError, GeneratorExit):
        trace.finish("cancelled")  # the HTTP client went away
        raise
    finally:
        trace.finish("error")


async def _first(chunks: AsyncIterator):
    try:
        return await chunks.__anext__()
    except StopAsyncIteration as e:
        raise ApiError(500, "no output", kind="server_error") from e


async def _sse(first, chunks: AsyncIterator, rid: str, created: int, model: str, chat: bool,
               include_usage: bool) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    last = first
    if chat:  # the role comes first, as OpenAI does
        yield _event({"id": rid, "object": obj, "created": created, "model": model, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})

    def event(c) -> str:
        finish = FINISH.get(c.finish_reason) if c.HasField("finish_reason") else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["delta"] = {"content": c.text} if c.text or not finish else {}
        else:
            choice["text"] = c.text
        return _event({"id": rid, "object": obj, "created": created, "model": model,
                       "choices": [choice], **({"usage": None} if include_usage else {})})

    try:
        yield event(first)
        async for c in chunks:
            last = c
            yield event(c)
    except ApiError as e:  # mid-stream: headers are sent, so the error goes in the stream
        yield _event({"error": {"message": str(e), "type": e.kind, "code": e.status}})
        return
    finally:
        await chunks.aclose()  # a client that left: release the request now
    if include_usage:
        yield _event({"id": rid, "object": obj, "created": created, "model": model,
                      "choices": [], "usage": _usage(last)})
    yield "data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
