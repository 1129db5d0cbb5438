"""Conditional disaggregation through a real router over real workers (P0 + D0): a concurrent
burst is split between remote and local prefill, every output equals the colocated run token for
token, and the remote ones really moved their KV (the decode worker's pulls match the router's
remote decisions: a recompute fallback would give the same tokens without a pull)."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest

from splitserve import scrape
from tests.e2e.cluster import ProcCluster
from tests.e2e.conftest import static_router
from tests.e2e.test_serving import _request, _stream
from tests.utils import GOLDEN_LENGTHS, make_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leak_check")]


def _decisions(cl: ProcCluster, router: str) -> dict[str, float]:
    """The router's `splitserve:routing_decisions_total` by where prefill ran."""
    return scrape.by_label(cl.metrics(router), "splitserve:routing_decisions_total", "prefill")


def test_a_conditional_burst_prefills_on_both_sides_and_matches_colocated(
        cl: ProcCluster, tiny_model_dir: Path) -> None:
    static_router(cl, "CD", ("P0",), ("D0",), (), "--conditional-disaggregation")
    prompts = make_prompts(tiny_model_dir, GOLDEN_LENGTHS * 2, seed=61)  # 32 requests
    ref = cl.generation(cl.by_name["R"])
    want = [_stream(ref, _request(p))[0] for p in prompts]
    stub = cl.generation(cl.by_name["CD"])
    d0 = cl.by_name["D0"]
    pulls = cl.worker_stats(d0).kv_pulls
    before = _decisions(cl, "CD")
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _stream(stub, _request(p))[0], prompts))
    for n, w, ids in zip(GOLDEN_LENGTHS * 2, want, got):
        assert ids == w, f"{n}-token prompt: {ids} != colocated {w}"
    after = _decisions(cl, "CD")
    remote = after.get("remote", 0) - before.get("remote", 0)
    local = after.get("local", 0) - before.get("local", 0)
    assert remote + local == len(prompts)
    # A burst on an idle pair: the first prompt finds D0 idle (local); the ones behind it find
    # it busy or queued (remote) until the prefill worker's queue is as long.
    assert remote >= 1 and local >= 1, f"{remote:.0f} remote, {local:.0f} local"
    assert cl.worker_stats(d0).kv_pulls - pulls == remote


def test_with_a_tpot_slo_no_prompt_prefills_beside_a_stream_it_would_push_past_it(
        cl: ProcCluster, tiny_model_dir: Path) -> None:
    """`--tpot-slo` reaches the rule: with an SLO no stream can meet (a microsecond per token),
    once a stream decodes on D0 every prompt prefills on P0, where the same burst without it
    (the test above) lands on both sides; and the outputs still equal the colocated run's."""
    static_router(cl, "CT", ("P0",), ("D0",), (), "--conditional-disaggregation",
                  "--tpot-slo", "0.000001")
    prompts = make_prompts(tiny_model_dir, GOLDEN_LENGTHS, seed=62)
    ref = cl.generation(cl.by_name["R"])
    want = [_stream(ref, _request(p))[0] for p in prompts]
    stub = cl.generation(cl.by_name["CT"])
    # Prompts of their own for the warm-up and the long stream: a prompt D0 already holds
    # whole is not pulled again (its own prefix cache serves it).
    # Five first tokens before the burst (four warm-ups and the long stream's): however the
    # router placed them, one worker's meter has its three samples, and the other's rate is
    # taken from it. With rates unknown the rule compares token counts and skips the TPOT check
    # (a run placed three warm-ups and the stream two on each side: 3 of 16 went local).
    *warm, lone = make_prompts(tiny_model_dir, [300, 300, 300, 300, 128], seed=63)
    for p in warm:  # one at a time: the router learns the workers' prefill rates
        _stream(stub, _request(p))
    d0 = cl.by_name["D0"]
    # A stream that outlasts the burst's placements (600 tokens), decoding on D0: its second
    # token is out, so its KV is there, pulled or computed.
    long_ = stub.Generate(_request(lone, max_tokens=600, ignore_eos=True), timeout=300)
    assert next(long_).token_ids and next(long_).token_ids
    pulls = cl.worker_stats(d0).kv_pulls
    before = _decisions(cl, "CT")
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _stream(stub, _request(p))[0], prompts))
    after = _decisions(cl, "CT")
    long_.cancel()
    for n, w, ids in zip(GOLDEN_LENGTHS, want, got):
        assert ids == w, f"{n}-token prompt: {ids} != colocated {w}"
    assert after.get("local", 0) == before.get("local", 0), (before, after)
    assert after["remote"] - before["remote"] == len(prompts)
    assert cl.worker_stats(d0).kv_pulls - pulls == len(prompts)
