"""Conditional disaggregation through a real router over real workers (P0 + D0): a concurrent
burst is split between remote and local prefill, every output equals the colocated run token for
token, and the remote ones really moved their KV (the decode worker's pulls match the router's
remote decisions: a recompute fallback would give the same tokens without a pull)."""

from __future__ import annotations

import concurrent.futures as cf
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.cluster import ProcCluster
from tests.e2e.conftest import static_router
from tests.e2e.test_serving import _request, _stream
from tests.utils import GOLDEN_LENGTHS, make_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leak_check")]


def _decisions(cl: ProcCluster, router: str) -> dict[str, float]:
    """The router's `splitserve:routing_decisions_total` by where prefill ran."""
    text = urllib.request.urlopen(cl.by_name[router].endpoints["http"] + "/metrics",
                                  timeout=10).read().decode()
    return {line.split('prefill="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("splitserve:routing_decisions_total{")}


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
