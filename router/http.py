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
import json.encoder
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio._backends._asyncio  # noqa: F401  (anyio loads it lazily: on the first request's TTFT)
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from router.errors import RequestFailed
from router.generation import GenerationService
from router.ids import new_id
from router.lifecycle import Lifecycle
from router.outcome import Outcome
from splitserve import finish
from splitserve.credentials import matches
from splitserve.v1 import generation_pb2

T = TypeVar("T")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, headers=self.headers, content={"error": {
            "message": str(self), "type": self.kind, "param": self.param, "code": self.code}})


def build_app(service: GenerationService, registry: CollectorRegistry,
              api_keys: tuple[str, ...] = ()) -> _Arrival:
    # A dependency of the /v1 routes, not an HTTP middleware: Starlette's BaseHTTPMiddleware
    # relays a streaming body through a memory channel, which delays every request's first token.
    async def auth(request: Request) -> None:
        if api_keys and not matches(request.headers.get("authorization"), api_keys):
            raise ApiError(401, "invalid or missing API key", kind="authentication_error",
                           code="invalid_api_key")

    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth)])

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
        body = await _json(request, service.cfg.limits.max_request_bytes)
        check_fields(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            req = _unicode("prompt", lambda: generation_pb2.GenerateRequest(text=prompt))
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                              and -2**63 <= t < 2**63 for t in prompt):
            req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt))
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")
        return await _run(service, request, req, body, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request, service.cfg.limits.max_request_bytes)
        check_fields(body, chat=True)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str)
                and isinstance(m.get("role"), str) and m["role"] for m in messages):
            raise ApiError(400, "messages must be a non-empty list of {role, content}",
                           "messages")
        req = _unicode("messages", lambda: generation_pb2.GenerateRequest(
            messages=generation_pb2.ChatMessages(messages=[
                generation_pb2.ChatMessage(role=m["role"], content=m["content"])
                for m in messages])))
        return await _run(service, request, req, body, chat=True)  # rendered in prepare()

    app.include_router(v1)
    return _Arrival(app)


ARRIVAL = "splitserve.arrival"  # the ASGI scope's key for when the request reached the router


class _Arrival:
    """Stamps each request's scope with its arrival (time.perf_counter()) before the app runs:
    the TTFT histogram starts there, not once the body is read and the handler runs. A plain
    ASGI wrapper: Starlette's middleware classes cost streams a relay (see `build_app`)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        scope[ARRIVAL] = time.perf_counter()
        await self.app(scope, receive, send)


# Request fields this front reads. Everything else a client sends is either a field that changes
# nothing at the value given (_NEUTRAL) or an error naming it: a field that is accepted and
# silently ignored (logprobs, penalties) gives a client an answer to a question it did not ask.
_COMMON = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                     "top_k", "seed", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "n",
                     "stream", "stream_options", "stream_interval", "timeout", "user"})
_FIELDS = {False: _COMMON | {"prompt"}, True: _COMMON | {"messages"}}
_NEUTRAL: dict[str, tuple[Any, ...]] = {  # value(s) at which an unsupported field is a no-op
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""),
}


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    # By type as well as value: in Python 0 == False and 1 == True, but `logprobs: 0` asks for
    # the sampled token's logprob while `logprobs: false` asks for nothing.
    for a in allowed:
        if a is None or isinstance(a, bool):
            if value is a:
                return True
        elif not isinstance(value, bool) and isinstance(value, type(a) | float) and value == a:
            return True
    return False


def check_fields(body: dict[str, Any], chat: bool) -> None:
    """400 naming the first field this front would otherwise ignore."""
    for key, value in body.items():
        if key in _FIELDS[chat]:
            continue
        if key not in _NEUTRAL:
            raise ApiError(400, f"unsupported field {key!r}", key)
        if not _neutral(value, _NEUTRAL[key]):
            raise ApiError(400, f"{key} is not supported: only {_NEUTRAL[key][1]!r} or null is "
                                f"accepted, got {value!r}", key)


def _unicode(param: str, build: Callable[[], T]) -> T:
    """JSON may carry lone surrogates ("\\ud800"), which no UTF-8 field can hold."""
    try:
        return build()
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param} is not valid Unicode: {e.reason}", param) from e


async def _json(request: Request, max_bytes: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes}")
    raw = bytearray()
    async for part in request.stream():  # a body without a length is counted as it arrives
        raw += part
        if len(raw) > max_bytes:
            raise ApiError(413, f"request body exceeds the limit of {max_bytes} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _sampling(body: dict[str, Any], req: generation_pb2.GenerateRequest) -> None:
    n = body.get("n")
    if n is not None and not _neutral(n, (1,)):
        raise ApiError(400, f"only n=1 is supported, got {n!r}", "n")
    sp = req.sampling
    try:
        for key in ("temperature", "top_p", "top_k", "max_tokens", "seed", "min_tokens",
                    "stream_interval"):
            value = body.get("max_completion_tokens") if key == "max_tokens" and body.get(
                "max_tokens") is None else body.get(key)
            if isinstance(value, bool):  # protobuf would take true as 1
                raise TypeError(f"{key} must be a number, got {value!r}")
            if value is not None:
                setattr(sp, key, value)
        stop = body.get("stop")
        if not isinstance(stop, str | list | None):
            raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
        sp.stop.extend([stop] if isinstance(stop, str) else (stop or []))
        sp.stop_token_ids.extend(body.get("stop_token_ids") or [])
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise TypeError(f"ignore_eos must be true or false, got {ignore_eos!r}")
        sp.ignore_eos = ignore_eos
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"bad sampling parameter: {e}") from e
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {model!r}", "model")
    if model:
        req.model = model


async def _run(service: GenerationService, request: Request,
               req: generation_pb2.GenerateRequest, body: dict[str, Any], chat: bool):
    _sampling(body, req)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{new_id()}"
    req.request_id = rid
    timeout = body.get("timeout")
    limit = service.cfg.limits.max_timeout_s
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not 0 < timeout <= limit):
        raise ApiError(400, f"timeout must be a number of seconds in (0, {limit:g}], "
                            f"got {timeout!r}", "timeout")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) or not isinstance(body.get("stream_options") or {}, dict):
        raise ApiError(400, "stream must be true or false and stream_options an object",
                       "stream")
    life = service.tracker.track(request.scope.get(ARRIVAL))
    chunks = _guard(service.stream(req, timeout, life), life)
    # Errors before the first chunk become HTTP statuses.
    first = await _unless_gone(request, _first(chunks), chunks)
    created = int(time.time())
    if stream:
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_sse(first, chunks, rid, created, service.served_model, chat,
                                      usage, life), media_type="text/event-stream")
    text, last = await _unless_gone(request, _collect(first, chunks, life), chunks)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish.to_word(last.finish_reason),
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


async def _collect(first, chunks: AsyncIterator, life: Lifecycle) -> tuple[str, Any]:
    """A non-streamed answer: its tokens count as they reach the router (the client gets them
    all at once, at the end)."""
    text, last = first.text, first
    life.sent(len(first.token_ids), first.HasField("finish_reason"))
    async for c in chunks:
        text += c.text
        last = c
        life.sent(len(c.token_ids), c.HasField("finish_reason"))
    return text, last


async def _unless_gone(request: Request, work: Awaitable[T], chunks: AsyncIterator) -> T:
    """`work`, unless the HTTP client disconnects first: then the request is closed (both
    workers abort it) and 499 answered to nobody. uvicorn does not cancel a handler whose client
    left, and StreamingResponse watches for it only once it streams: without this a client that
    gave up during a long prefill, or on a non-streaming request, left the workers generating."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await task
            await chunks.aclose()
    if not task.done() or task.cancelled():
        raise ApiError(499, "the client closed the request", kind="client_closed")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(c: generation_pb2.GenerateResponse) -> dict[str, int]:
    p, n = c.usage.prompt_tokens, c.usage.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


async def _guard(chunks: AsyncIterator, life: Lifecycle) -> AsyncIterator:
    """The stream, its failures as ApiErrors, its outcome counted."""
    try:
        async with contextlib.aclosing(chunks):  # closed now, not whenever it is collected
            async for c in chunks:
                yield c
    except BaseException as e:  # a failure, or the client gone (GeneratorExit, CancelledError)
        outcome = life.end(e)
        if isinstance(e, RequestFailed):
            raise api_error(outcome) from e
        raise
    life.end()  # counted already, unless the stream ran out without its last chunk


def api_error(outcome: Outcome) -> ApiError:
    """A failed request's outcome as an OpenAI error and its HTTP status."""
    if outcome.field is not None:  # an invalid argument
        status = 404 if outcome.field == "model" else 400
        # OpenAI names request fields flat ("temperature", not "sampling.temperature").
        return ApiError(status, outcome.message, outcome.field.removeprefix("sampling."),
                        code="model_not_found" if status == 404 else None)
    status = outcome.http_status
    retry = outcome.retry_after_s
    return ApiError(status, outcome.message,
                    kind="invalid_request_error" if status == 400 else "server_error",
                    headers={"Retry-After": str(math.ceil(retry))} if retry is not None
                    else RETRY_UNAVAILABLE if status == 503 else None)


# A 503 (no worker for the request, or draining) asks clients to come back, as a 429 does:
# workers (re)join within a heartbeat or two.
RETRY_UNAVAILABLE = {"Retry-After": "1"}


async def _first(chunks: AsyncIterator):
    try:
        return await chunks.__anext__()
    except StopAsyncIteration as e:
        raise ApiError(500, "no output", kind="server_error") from e


async def _sse(first, chunks: AsyncIterator, rid: str, created: int, model: str, chat: bool,
               include_usage: bool, life: Lifecycle) -> AsyncIterator[str]:
    """The stream's server-sent events. Starlette resumes this generator only once it has
    written the previous event to the connection: that is where each chunk counts as sent."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    last = first
    if chat:  # the role comes first, as OpenAI does
        yield _event({"id": rid, "object": obj, "created": created, "model": model, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})

    def event(c) -> str:
        word = finish.to_word(c.finish_reason) if c.HasField("finish_reason") else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": word, "logprobs": None}
        if chat:
            choice["delta"] = {"content": c.text} if c.text or not word else {}
        else:
            choice["text"] = c.text
        return _event({"id": rid, "object": obj, "created": created, "model": model,
                       "choices": [choice], **({"usage": None} if include_usage else {})})

    # Every chunk but the last differs only in its text: the event around it is rendered once
    # (json.dumps of the whole object cost ~5 µs a token; the text alone, ~0.3 µs).
    head, tail = event(generation_pb2.GenerateResponse(text=_MARK)).split(_encode(_MARK))

    def token_event(c) -> str:
        return event(c) if c.HasField("finish_reason") else head + _encode(c.text) + tail

    try:
        yield token_event(first)
        life.sent(len(first.token_ids), first.HasField("finish_reason"))
        async for c in chunks:
            last = c
            yield token_event(c)
            life.sent(len(c.token_ids), c.HasField("finish_reason"))
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


_MARK = "\x00text\x00"  # stands for a chunk's text while its event is rendered
_encode = json.encoder.encode_basestring  # a str as JSON, as json.dumps(ensure_ascii=False)
