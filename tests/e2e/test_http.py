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
    assert stub.Complete(req, timeout=30, metadata=[("authorization", f"Bearer {API_KEY}")])


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
