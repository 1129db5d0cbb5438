"""Fuzzing the public APIs of a live router with real workers: 3,000 generated requests over gRPC
and 3,000 over HTTP in the soak tier, a seeded sample of 750 each in CI — wrong types, huge and
negative numbers, NaN, unicode and control characters, unknown fields, malformed and truncated
bodies and messages.

What must hold: every request ends, within its client timeout, with a documented status; a 200
answer has the OpenAI shape and usage that adds up, a 200 stream whole JSON events and one finish
reason before `[DONE]` (or a documented error event); the router never crashes; its memory stays
bounded. Hypothesis draws the requests in batches of BATCH that are sent concurrently, so the
valid ones share engine steps. The draws are derandomized so that CI runs the same ones every
time; SPLITSERVE_FUZZ_RANDOM=1 explores new ones.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.v1 import common_pb2, generation_pb2
from tests.conftest import SOAK
from tests.e2e.cluster import ProcCluster

pytestmark = [pytest.mark.slow, pytest.mark.tiered, pytest.mark.usefixtures("leak_check")]
# 3,000 requests per API took 4-6 minutes on a slow CI host, a fifth of the whole run's budget:
# CI draws 15 batches (derandomized: the same ones every run), the soak tier 60.
BATCH, BATCHES = 50, 60 if SOAK else 15
CLIENT_TIMEOUT_S = 60.0  # a request still open after this is a hang
RSS_GROWTH_MB = 100  # after 3,000 requests; a leak of a few KB per request would pass it
SETTINGS = settings(max_examples=BATCHES, deadline=None, database=None,
                    derandomize=not os.environ.get("SPLITSERVE_FUZZ_RANDOM"),
                    suppress_health_check=list(HealthCheck))

# Documented outcomes (docs/operations.md, "Status codes").
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
HTTP_OK = {200, 400, 404, 413, 429, 504}  # 504: the body's own `timeout` (some are tiny)

_any_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=30))
_any_json = st.recursive(_any_scalar, lambda c: st.lists(c, max_size=4)
                         | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10)
_small_tokens = st.one_of(st.integers(1, 4), st.integers(-2**31, 0),
                          st.integers(5000, 2**31 - 1))  # valid requests stay short
_f32 = st.floats(width=32)
_i32, _i64 = st.integers(-2**31, 2**31 - 1), st.integers(-2**63, 2**63 - 1)
_ids = st.lists(st.one_of(st.integers(0, 4000), _i64), max_size=60)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# --- gRPC -------------------------------------------------------------------------------------

# Per field: values a worker can run, and anything the type allows.
_GOOD = {"temperature": st.floats(0, 2, width=32), "top_p": st.floats(0.125, 1, width=32),
         "top_k": st.integers(-1, 50), "min_tokens": st.integers(0, 1), "seed": _i64,
         "logprobs": st.integers(0, 20)}
_ANY = {"temperature": _f32, "top_p": _f32, "top_k": _i32, "min_tokens": _i32, "seed": _i64,
        "logprobs": _i32}


@st.composite
def grpc_request(draw, served: str) -> bytes:
    # One in eight meant to run, so the workers get traffic too (each costs a prefill, a KV
    # hand-off and a few decode steps: a third of 10,000 took minutes on a 2-core host).
    good = draw(st.integers(0, 7)) == 0
    req = generation_pb2.GenerateRequest()
    if draw(st.booleans()):
        req.text = draw(st.text(min_size=1 if good else 0, max_size=200))
    elif good or draw(st.booleans()):
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, 4000), min_size=1, max_size=60)
                                      if good else _ids))
    req.model = draw(st.sampled_from(["", served]) if good else
                     st.one_of(st.just(""), st.just(served), st.text(max_size=20)))
    if draw(st.booleans()):
        req.request_id = draw(st.text(max_size=300))
    sp = req.sampling
    for name in _GOOD:
        if draw(st.booleans()):
            setattr(sp, name, draw((_GOOD if good else _ANY)[name]))
    sp.max_tokens = draw(st.integers(1, 4) if good else _small_tokens)  # unset: 16 tokens
    sp.stop.extend(draw(st.lists(st.text(min_size=1 if good else 0, max_size=40), max_size=20)))
    sp.stop_token_ids.extend(draw(st.lists(st.integers(0, 4000) if good else _i64, max_size=8)))
    sp.ignore_eos = draw(st.booleans())
    for name in ("skip_special_tokens", "skip_detokenize", "local_prefill"):
        if draw(st.booleans()):
            setattr(req, name, draw(st.booleans()))
    raw = req.SerializeToString()
    kind = draw(st.sampled_from(["proto"] * 6 + ["truncated", "bytes"]))
    if kind == "truncated" and raw:
        return raw[:draw(st.integers(0, len(raw) - 1))]
    return draw(st.binary(max_size=200)) if kind == "bytes" else raw


async def _grpc_one(ch: grpc.aio.Channel, raw: bytes) -> tuple[grpc.StatusCode, str]:
    method = ch.unary_stream("/splitserve.v1.Generation/Generate",
                             request_serializer=None,  # raw bytes: malformed ones too
                             response_deserializer=generation_pb2.GenerateResponse.FromString)
    call = method(raw, timeout=CLIENT_TIMEOUT_S)
    finished = False
    try:
        async for chunk in call:
            assert not finished, "a chunk after the final one"
            finished = chunk.HasField("finish_reason")
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    assert finished, "the stream ended without a final chunk"
    return grpc.StatusCode.OK, ""


def test_fuzz_grpc(cl: ProcCluster) -> None:
    a = cl.by_name["A"]
    served = Path(cl.model).name
    seen: dict[grpc.StatusCode, int] = {}
    rss0 = _rss_mb(a.popen.pid)

    @SETTINGS
    @given(st.lists(grpc_request(served), min_size=BATCH, max_size=BATCH))
    def batch(raws: list[bytes]) -> None:
        async def run() -> list[tuple[grpc.StatusCode, str]]:
            async with grpc.aio.insecure_channel(a.address) as ch:
                return await asyncio.gather(*(_grpc_one(ch, r) for r in raws))

        for code, details in asyncio.run(run()):
            assert code in GRPC_OK, f"{code.name}: {details}"
            seen[code] = seen.get(code, 0) + 1

    batch()
    print("gRPC outcomes:", {c.name: n for c, n in seen.items()},
          f"router RSS {rss0:.0f} -> {_rss_mb(a.popen.pid):.0f} MB")
    assert sum(seen.values()) >= BATCH * BATCHES
    assert seen.get(grpc.StatusCode.OK, 0) >= BATCHES * 2, "too few valid requests to mean a thing"
    assert a.popen.poll() is None
    assert _rss_mb(a.popen.pid) - rss0 < RSS_GROWTH_MB
    req = generation_pb2.GenerateRequest(text="still serving", sampling=common_pb2.SamplingParams(
        max_tokens=2))
    assert cl.generation(a).Complete(req, timeout=30).usage.completion_tokens >= 1


# --- HTTP -------------------------------------------------------------------------------------

_FIELD_VALUES = {
    "prompt": st.one_of(st.text(max_size=200), _ids, st.lists(st.text(max_size=20), max_size=3)),
    "messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", ""]),
         "content": st.text(max_size=100)}), max_size=3), _any_json),
    "max_tokens": _small_tokens, "max_completion_tokens": _small_tokens,
    "temperature": st.floats(), "top_p": st.floats(), "top_k": st.integers(), "seed": st.integers(),
    "min_tokens": st.integers(), "stop": st.one_of(st.text(max_size=20),
                                                   st.lists(st.text(max_size=20), max_size=20)),
    "stop_token_ids": st.lists(st.integers(), max_size=5), "ignore_eos": st.booleans(),
    "n": st.integers(-1, 3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "timeout": st.floats(), "logprobs": st.one_of(st.none(), st.booleans(), st.integers(0, 5)),
    "presence_penalty": st.floats(-2, 2), "user": st.text(max_size=10),
}


@st.composite
def http_request(draw) -> tuple[str, bytes, dict[str, str]]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body: dict = {}
    for key in draw(st.lists(st.sampled_from(sorted(_FIELD_VALUES)), max_size=8, unique=True)):
        body[key] = draw(st.one_of(_FIELD_VALUES[key], _any_json) if draw(st.booleans())
                         else _FIELD_VALUES[key])
    if draw(st.booleans()):  # mostly something a worker can run
        body.setdefault("prompt" if path.endswith("/completions") and "chat" not in path
                        else "messages", [{"role": "user", "content": "hi"}]
                        if "chat" in path else "hi")
        body["max_tokens"] = draw(st.integers(1, 4))
        body.pop("max_completion_tokens", None)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=10))] = draw(_any_json)  # unknown field
    raw = json.dumps(body, allow_nan=True).encode()  # NaN and Infinity literals too
    kind = draw(st.sampled_from(["json"] * 6 + ["truncated", "garbage", "other-json"]))
    if kind == "truncated":
        raw = raw[:draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif kind == "garbage":
        raw = draw(st.binary(max_size=200))
    elif kind == "other-json":
        raw = json.dumps(draw(_any_json)).encode()
    headers = {"content-type": draw(st.sampled_from(["application/json", "text/plain", ""]))}
    return path, raw, headers


async def _http_one(client: httpx.AsyncClient, path: str, raw: bytes,
                    headers: dict[str, str]) -> tuple[int, str]:
    async with client.stream("POST", path, content=raw, headers=headers) as r:
        body = (await r.aread()).decode("utf-8", errors="replace")
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        _check_stream(path, body)
    elif r.status_code == 200:
        _check_answer(path, json.loads(body))
    else:
        assert json.loads(body)["error"]["message"], body  # an OpenAI error object
    return r.status_code, body[:200]


FINISH = {"stop", "length", "abort"}


def _check_choice(path: str, choice: dict, streamed: bool) -> None:
    if "chat" not in path:
        assert isinstance(choice["text"], str), choice
    elif streamed:
        assert set(choice["delta"]) <= {"role", "content"}, choice
    else:
        assert choice["message"]["role"] == "assistant", choice
        assert isinstance(choice["message"]["content"], str), choice
    assert choice["finish_reason"] in (FINISH | {None} if streamed else FINISH), choice


def _check_answer(path: str, answer: dict) -> None:
    """A whole 200 answer: one choice of the right shape, its usage adding up."""
    (choice,) = answer["choices"]
    _check_choice(path, choice, streamed=False)
    usage = answer["usage"]
    assert usage["prompt_tokens"] >= 1 and usage["completion_tokens"] >= 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage


def _check_stream(path: str, body: str) -> None:
    """A 200 stream: whole JSON events, one finish reason, then `[DONE]`; or, where the request
    failed after its headers went out, a last event that is an OpenAI error with a documented
    status (the body's own `timeout`, 504), never a stream cut off mid-way."""
    lines = [ln for ln in body.split("\n\n") if ln.strip()]
    assert lines and all(ln.startswith("data: ") for ln in lines), body[-300:]
    events = [ln[len("data: "):] for ln in lines]
    if events[-1] == "[DONE]":
        chunks = [json.loads(e) for e in events[:-1]]
        finishes = [c["finish_reason"] for ch in chunks for c in ch["choices"]
                    if c["finish_reason"]]
        assert len(finishes) == 1, body[-300:]
    else:
        error = json.loads(events[-1])["error"]
        assert error["message"] and error["code"] in HTTP_OK, error
        chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        for choice in chunk["choices"]:  # none in the closing usage chunk
            _check_choice(path, choice, streamed=True)


def test_fuzz_http(cl: ProcCluster) -> None:
    a = cl.by_name["A"]
    seen: dict[int, int] = {}
    rss0 = _rss_mb(a.popen.pid)

    @SETTINGS
    @given(st.lists(http_request(), min_size=BATCH, max_size=BATCH))
    def batch(reqs: list[tuple[str, bytes, dict[str, str]]]) -> None:
        async def run() -> list[tuple[int, str]]:
            async with httpx.AsyncClient(base_url=a.endpoints["http"],
                                         timeout=CLIENT_TIMEOUT_S) as client:
                return await asyncio.gather(*(_http_one(client, *r) for r in reqs))

        for status, body in asyncio.run(run()):
            assert status in HTTP_OK, f"{status}: {body}"
            seen[status] = seen.get(status, 0) + 1

    batch()
    print("HTTP outcomes:", seen, f"router RSS {rss0:.0f} -> {_rss_mb(a.popen.pid):.0f} MB")
    assert sum(seen.values()) >= BATCH * BATCHES
    assert seen.get(200, 0) >= BATCHES * 2, "too few valid requests to mean anything"
    assert a.popen.poll() is None
    assert _rss_mb(a.popen.pid) - rss0 < RSS_GROWTH_MB
