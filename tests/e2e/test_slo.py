"""SLO-aware admission through a real router over real workers: a burst the pool cannot prefill
within the TTFT SLO is partly refused at once, over gRPC and HTTP alike, with a retry hint; what
is admitted completes; nothing leaks.

The burst is sized from the rate the router itself measured on the warm-up (its
`splitserve:prefill_tokens_per_second`), so it holds about four SLOs' worth of prefill on a fast
host and a slow one alike: without the admission check every request would be queued and served.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from pathlib import Path

import grpc
import httpx
import pytest

from splitserve import scrape
from tests.e2e.cluster import ProcCluster
from tests.e2e.conftest import static_router
from tests.e2e.test_serving import _request, _stream
from tests.utils import make_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leak_check")]
SLO_S = 1.0
PROMPT = 3000  # tokens: long prompts, so a burst is many SLOs of prefill in few requests
MAX_BURST = 48


def _gauge(cl: ProcCluster, router: str, name: str) -> float:
    return scrape.total(cl.metrics(router), name)


def test_a_burst_beyond_the_ttft_slo_is_refused_at_once_with_a_retry_hint(
        cl: ProcCluster, tiny_model_dir: Path) -> None:
    static_router(cl, "L", ("P0",), ("D0",), (), "--admit-ttft-slo", str(SLO_S))
    stub = cl.generation(cl.by_name["L"])
    warm = make_prompts(tiny_model_dir, [PROMPT] * 3, seed=41)
    for ids in warm:  # the meter predicts nothing before it has seen three requests
        _stream(stub, _request(ids, max_tokens=2))
    rate = _gauge(cl, "L", "splitserve:prefill_tokens_per_second")
    assert rate > 0
    burst = min(MAX_BURST, math.ceil(4 * SLO_S * rate / PROMPT) + 2)
    prompts = make_prompts(tiny_model_dir, [PROMPT] * burst, seed=42)
    before = cl.outcomes("L")
    url = cl.by_name["L"].endpoints["http"] + "/v1/completions"
    model = Path(cl.model).name

    def over_grpc(ids: list[int]) -> tuple[str, object]:
        try:
            return "done", _stream(stub, _request(ids, max_tokens=2))[0]
        except grpc.RpcError as e:
            return e.code().name, dict(e.trailing_metadata() or ())

    def over_http(ids: list[int]) -> tuple[str, object]:
        r = httpx.post(url, json={"model": model, "prompt": ids, "max_tokens": 2}, timeout=120)
        if r.status_code == 200:
            return "done", r.json()["choices"][0]["text"]
        return str(r.status_code), (r.headers.get("retry-after"), r.json()["error"]["message"])

    with cf.ThreadPoolExecutor(burst) as pool:
        futures = [pool.submit(over_grpc if i % 2 == 0 else over_http, ids)
                   for i, ids in enumerate(prompts)]
        results = [f.result() for f in futures]
    kinds = [k for k, _ in results]
    assert set(kinds) <= {"done", "RESOURCE_EXHAUSTED", "429"}, results
    refused = [r for r in results if r[0] != "done"]
    assert "done" in kinds and refused, f"burst of {burst} at {rate:.0f} tokens/s: {kinds}"
    for kind, detail in refused:
        if kind == "429":
            retry_after, message = detail
            assert int(retry_after) >= 1 and "exceeds the SLO of 1 s" in message
        else:
            assert int(detail["grpc-retry-pushback-ms"]) > 0
    # The router counted each refusal as such, and every admitted request finished.
    after = cl.outcomes("L")
    assert after["rejected"] - before["rejected"] == len(refused)
    assert after["finished"] - before["finished"] == kinds.count("done")


def test_streams_that_would_miss_the_tpot_slo_are_refused_over_grpc_and_http(
        cl: ProcCluster, tiny_model_dir: Path) -> None:
    """A TPOT SLO below any decode step this host can take: the router admits while it knows
    nothing (three streams), learns their time per token from them, then refuses at once."""
    static_router(cl, "V", (), (), ("C",), "--admit-tpot-slo", "0.0002")
    stub = cl.generation(cl.by_name["V"])
    prompts = make_prompts(tiny_model_dir, [40] * 5, seed=43)
    for ids in prompts[:3]:
        assert len(_stream(stub, _request(ids, max_tokens=8, ignore_eos=True))[0]) == 8
    before = cl.outcomes("V")
    with pytest.raises(grpc.RpcError) as e:
        _stream(stub, _request(prompts[3], max_tokens=8))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "predicted time per output token" in e.value.details()
    assert "exceeds the SLO of 0.2 ms" in e.value.details()
    assert int(dict(e.value.trailing_metadata())["grpc-retry-pushback-ms"]) >= 100
    r = httpx.post(cl.by_name["V"].endpoints["http"] + "/v1/completions", timeout=60,
                   json={"model": Path(cl.model).name, "prompt": prompts[4], "max_tokens": 8})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert "time per output token" in r.json()["error"]["message"]
    assert cl.outcomes("V")["rejected"] - before["rejected"] == 2
