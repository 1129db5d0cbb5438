"""The OpenAI-compatible HTTP front and the metrics, against the shared e2e cluster."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

from splitserve.v1 import common_pb2, generation_pb2
from tests.e2e.cluster import ProcCluster
from tests.e2e.conftest import API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leak_check")]
PROMPT = "The quick brown fox and the quiet garden"


def _name(cl: ProcCluster) -> str:
    return Path(cl.model).name  # the served name defaults to the model directory's name


def _client(cl: ProcCluster, router: str = "A", key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=cl.by_name[router].endpoints["http"] + "/v1", api_key=key,
                         max_retries=0, timeout=60)


def _grpc_text(cl: ProcCluster, text: str, max_tokens: int) -> generation_pb2.CompleteResponse:
    req = generation_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens))
    return cl.generation(cl.by_name["A"]).Complete(req, timeout=60)


def test_completions_equal_grpc_streaming_and_not(cl: ProcCluster) -> None:
    want = _grpc_text(cl, PROMPT, 20)
    client = _client(cl)
    full = client.completions.create(model=_name(cl), prompt=PROMPT, max_tokens=20,
                                     temperature=0)
    assert full.choices[0].text == want.text
    assert full.usage.prompt_tokens == want.usage.prompt_tokens
    assert full.usage.completion_tokens == len(want.token_ids)
    assert full.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.completions.create(model=_name(cl), prompt=PROMPT, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens


def test_stream_interval_gives_fewer_events_with_the_same_text(cl: ProcCluster) -> None:
    want = _grpc_text(cl, PROMPT, 24)
    chunks = list(_client(cl).completions.create(
        model=_name(cl), prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        extra_body={"stream_interval": 6}))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == want.text
    # Router A disaggregates: the prefill worker's token and the decode engine's first output
    # each come alone, then six at a time (one token per event would be 24 events).
    assert len(texts) <= 2 + -(-22 // 6), texts


def test_chat_equals_grpc_on_the_templated_prompt(cl: ProcCluster) -> None:
    msgs = [{"role": "user", "content": "Tell me about the river."}]
    templated = "<|bos|>### user:\nTell me about the river.\n<|eos|>### assistant:\n"
    client = _client(cl)
    full = client.chat.completions.create(model=_name(cl), messages=msgs, max_tokens=16,
                                          temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=_name(cl), messages=msgs, max_tokens=16,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    # The same prompt over gRPC, with the template applied by hand, gives the same text.
    tok = cl.generation(cl.by_name["A"]).Tokenize(generation_pb2.TokenizeRequest(
        text=templated, add_special_tokens=False), timeout=10)
    req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=tok.token_ids),
                                         sampling=common_pb2.SamplingParams(temperature=0,
                                                                            max_tokens=16))
    assert cl.generation(cl.by_name["A"]).Complete(req, timeout=60).text == text
    assert full.usage.prompt_tokens == len(tok.token_ids)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": "hi", "temperature": 3}, 400, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ({"prompt": "hi", "n": 3}, 400, "n"),
    # Accepted and silently ignored before: now refused, naming the field (or honoured when neutral)
    ({"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": 0}, 400, "logprobs"),  # 0 == False, but asks for logprobs
    ({"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "hi", "tools": []}, 400, "tools"),
    ({"prompt": "hi", "stop": ["x"] * 17}, 400, "stop"),
    ({"prompt": "hi", "stop": "y" * 1025}, 400, "stop"),
    ({"prompt": "hi", "stop_token_ids": [10**7]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "timeout": 1e9}, 400, "timeout"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "stream_interval": 0}, 400, "stream_interval"),
    ({"prompt": "hi", "stream_interval": "4"}, 400, None),  # a bad type: not a sampling rule
    ({"prompt": [1, 10**30]}, 400, "prompt"),  # not an int64: was a 500
    ({"prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate: no UTF-8 field holds it
])
def test_bad_requests_get_status_and_openai_error_body(cl, body, status, param) -> None:
    # json.dumps escapes what httpx's own encoder refuses (a lone surrogate).
    r = httpx.post(cl.by_name["A"].endpoints["http"] + "/v1/completions", timeout=30,
                   content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_neutral_values_of_unsupported_fields_are_accepted(cl: ProcCluster) -> None:
    # What vLLM's own `vllm bench serve` sends: repetition_penalty 1.0 and logprobs null.
    r = httpx.post(cl.by_name["A"].endpoints["http"] + "/v1/completions", timeout=60, json={
        "prompt": "hi", "max_tokens": 2, "repetition_penalty": 1.0, "logprobs": None,
        "presence_penalty": 0, "user": "u1"})
    assert r.status_code == 200, r.text


def test_body_over_the_limit_is_413_before_it_is_parsed(cl: ProcCluster) -> None:
    url = cl.by_name["A"].endpoints["http"] + "/v1/completions"
    big = b'{"prompt": "' + b"a" * (8 << 20) + b'"}'  # the default limit is 8 MiB
    r = httpx.post(url, content=big, timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunked():  # no content-length: counted as it arrives
        for _ in range(9):
            yield b"a" * (1 << 20)
    r = httpx.post(url, content=chunked(), timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_invalid_json_and_chat_without_messages(cl: ProcCluster) -> None:
    base = cl.by_name["A"].endpoints["http"]
    r = httpx.post(base + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for messages in ([], [{"role": 7, "content": "hi"}], [{"role": "user", "content": "\ud800"}]):
        r = httpx.post(base + "/v1/chat/completions", content=json.dumps({"messages": messages}),
                       timeout=30, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_no_workers_is_503_and_models_and_health(cl: ProcCluster) -> None:
    e = cl.by_name["E"].endpoints["http"]
    r = httpx.post(e + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert httpx.get(e + "/health", timeout=10).status_code == 503
    a = cl.by_name["A"].endpoints["http"]
    assert httpx.get(a + "/health", timeout=10).json() == {"status": "ok"}
    models = _client(cl).models.list()
    assert [m.id for m in models.data] == [_name(cl)]


def test_api_key_on_http_and_grpc(cl: ProcCluster) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(cl, "K", key="wrong").completions.create(model=_name(cl), prompt="hi",
                                                          max_tokens=2)
    ok = _client(cl, "K", key=API_KEY).completions.create(model=_name(cl), prompt="hi",
                                                           max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1
    import grpc

    stub = cl.generation(cl.by_name["K"])
    req = generation_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
        max_tokens=2))
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    done = stub.Complete(req, timeout=30, metadata=[("authorization", f"Bearer {API_KEY}")])
    assert len(done.token_ids) == done.usage.completion_tokens >= 1 and done.text


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("splitserve:"):
            name, value = line.rsplit(" ", 1)
            key = re.sub(r',?worker="[^"]*"', "", name)
            out[key] = out.get(key, 0.0) + float(value)
    return out


def test_metrics_move_by_exactly_the_requests_sent(cl: ProcCluster) -> None:
    router = cl.by_name["A"].endpoints["http"] + "/metrics"
    decoders = [cl.by_name[n].endpoints["metrics"] for n in ("D0", "D1")
                if cl.by_name[n].popen.poll() is None]
    model = f'model_name="{_name(cl)}"'

    def transfers() -> float:
        return sum(v for url in decoders for k, v in _scrape(url).items()
                   if k.startswith("splitserve:kv_transfers_total"))

    before, t_before = _scrape(router), transfers()
    n, max_tokens = 5, 6
    generated = sum(_grpc_text(cl, f"{PROMPT} {i}", max_tokens).usage.completion_tokens
                    for i in range(n))
    after = _scrape(router)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta(f'splitserve:requests_total{{{model},outcome="finished"}}') == n
    assert delta(f"splitserve:time_to_first_token_seconds_count{{{model}}}") == n
    assert delta(f"splitserve:e2e_request_latency_seconds_count{{{model}}}") == n
    assert delta(f"splitserve:request_queue_time_seconds_count{{{model}}}") == n
    assert delta(f'splitserve:routing_decisions_total{{{model},prefill="remote"}}') == n
    assert delta(f"splitserve:generation_tokens_total{{{model}}}") == generated
    # Each disaggregated request pulled its KV once (vLLM reports stats a step late: poll).
    deadline = time.monotonic() + 10
    while transfers() - t_before < n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert transfers() - t_before == n


def _readme_blocks(lang: str) -> list[str]:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_curl_and_openai_examples_work_as_written(cl: ProcCluster) -> None:
    """The README's examples, pointed at this cluster's router instead of 127.0.0.1:8000."""
    import subprocess
    import sys

    base = cl.by_name["A"].endpoints["http"]

    def here(code: str) -> str:
        return code.replace("http://127.0.0.1:8000", base).replace('"smollm2"', f'"{_name(cl)}"')

    (curl,) = [b for b in _readme_blocks("bash") if b.startswith("curl")]
    out = subprocess.run(["bash", "-c", here(curl)], capture_output=True, text=True, timeout=60)
    body = json.loads(out.stdout)
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1
    (py,) = _readme_blocks("python")
    out = subprocess.run([sys.executable, "-c", here(py)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]


def _closed(url: str) -> dict[tuple[str, str], float]:
    return {(re.search(r'by="(\w+)"', k)[1], re.search(r'reason="(\w+)"', k)[1]): v
            for k, v in _scrape(url + "/metrics").items()
            if k.startswith("splitserve:http_connections_closed_total")}


@pytest.mark.parametrize("router", ["B", "O"])
def test_a_burst_of_32_connections_each_gets_an_answer_or_a_refusal(cl: ProcCluster,
                                                                    router: str) -> None:
    """32 clients connect at once (AIPerf's burst at concurrency 32): each gets its whole stream
    or a 429/503 with Retry-After, none a closed connection. B: 1P1D, room for all of them;
    O: one slot and a one-deep queue, so most are refused."""
    import asyncio

    url = cl.by_name[router].endpoints["http"]
    before = _closed(url)

    async def one(client: httpx.AsyncClient, go: asyncio.Event, i: int) -> tuple[int, str]:
        await go.wait()
        body = {"model": _name(cl), "stream": True, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": f"{PROMPT} {i}"}]}
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            text = "".join([line async for line in r.aiter_lines()])
            if r.status_code in (429, 503):
                assert "retry-after" in r.headers, r.headers
            return r.status_code, text

    async def burst() -> list[tuple[int, str]]:
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            go = asyncio.Event()
            tasks = [asyncio.ensure_future(one(client, go, i)) for i in range(32)]
            await asyncio.sleep(0)  # every task waits at the gate, then all go at once
            go.set()
            return await asyncio.gather(*tasks)

    got = asyncio.run(burst())
    statuses = [s for s, _ in got]
    assert set(statuses) <= {200, 429, 503}, statuses
    for s, text in got:
        if s == 200:
            assert text.endswith("data: [DONE]"), text[-200:]
    if router == "B":
        assert statuses == [200] * 32
    else:
        assert statuses.count(200) >= 2 and 429 in statuses  # the slot, the queue, refusals
    after = _closed(url)
    assert all(after.get(k, 0) == before.get(k, 0) for k in after if k[0] == "server"), after
    # Closed by the clients: the burst's 32 and the first scrape's own connection, at most.
    assert sum(after.values()) - sum(before.values()) <= 33


def test_ttft_counts_from_arrival_not_from_the_read_body(cl: ProcCluster) -> None:
    """The router's TTFT starts when a request's headers arrive, not when its handler has the
    body: a client whose body comes 1 s after its headers waited 1 s more for its first token."""
    import socket

    url = cl.by_name["B"].endpoints["http"]
    host, port = url.removeprefix("http://").split(":")
    name = "splitserve:time_to_first_token_seconds_sum"
    before = sum(v for k, v in _scrape(url + "/metrics").items() if k.startswith(name))
    body = json.dumps({"model": _name(cl), "prompt": PROMPT, "max_tokens": 2, "stream": True,
                       "temperature": 0}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(body))
        time.sleep(1.0)
        s.sendall(body)
        answer = b""
        while b"[DONE]" not in answer:
            chunk = s.recv(65536)
            assert chunk, answer
            answer += chunk
    after = sum(v for k, v in _scrape(url + "/metrics").items() if k.startswith(name))
    assert after - before >= 1.0, f"TTFT {after - before:.3f} s for a request 1 s in the making"


def test_connections_closed_are_counted_by_side_and_reason(cl: ProcCluster) -> None:
    """A malformed request: the server answers 400 and closes (server, bad_request); a client
    that leaves mid-stream (client, mid_request)."""
    import socket

    url = cl.by_name["B"].endpoints["http"]
    host, port = url.removeprefix("http://").split(":")
    before = _closed(url)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 400")
    body = {"model": _name(cl), "prompt": PROMPT, "max_tokens": 64, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            next(r.iter_lines())  # the first event, then leave
    deadline = time.monotonic() + 10
    while True:
        after = _closed(url)
        moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        if moved.get(("client", "mid_request")) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert moved[("server", "bad_request")] == 1, moved
    assert moved[("client", "mid_request")] == 1, moved
