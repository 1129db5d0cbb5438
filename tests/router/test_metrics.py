"""Metric contracts: every metric the Grafana dashboard queries is one the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]


def _exported_samples() -> set[str]:
    from splitserve.engine import EngineConfig
    from splitserve.worker.config import WorkerConfig
    from splitserve.worker.core import WorkerCore
    from splitserve.worker.metrics import _Collector

    reg = CollectorRegistry()
    m = RouterMetrics(reg, "m")
    trace = m.trace()  # one finished request, so labelled histograms have samples
    trace.admitted(3, remote_prefill=True)
    trace.tokens(1)
    trace.tokens(2)
    trace.finish("finished")
    for role in ("prefill", "decode"):
        m.workers.labels("m", role).set(1)
    core = WorkerCore(WorkerConfig(role="decode", engine=EngineConfig(model="m")), "m")
    reg.register(_Collector(core, ["m", "decode", "w"]))
    from prometheus_client import Histogram

    Histogram("splitserve:kv_transfer_seconds", "", ["x"], registry=reg).labels("a").observe(1)
    return {s.name for fam in reg.collect() for s in fam.samples}


def test_every_dashboard_metric_is_exported() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "splitserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"splitserve:[a-z0-9_]+", e)}
    assert len(used) >= 15
    missing = used - _exported_samples()
    assert not missing, f"dashboard queries metrics nobody exports: {sorted(missing)}"


def test_trace_counts_each_request_once() -> None:
    reg = CollectorRegistry()
    m = RouterMetrics(reg, "m")
    t = m.trace()
    t.admitted(5, remote_prefill=False)
    t.tokens(1)
    t.tokens(1)
    t.finish("finished")
    t.finish("error")  # a later path must not count it twice
    value = reg.get_sample_value
    assert value("splitserve:requests_total", {"model_name": "m", "outcome": "finished"}) == 1
    assert value("splitserve:requests_total", {"model_name": "m", "outcome": "error"}) == 0
    assert value("splitserve:time_to_first_token_seconds_count", {"model_name": "m"}) == 1
    assert value("splitserve:inter_token_latency_seconds_count", {"model_name": "m"}) == 1
    assert value("splitserve:generation_tokens_total", {"model_name": "m"}) == 2
    assert value("splitserve:prompt_tokens_total", {"model_name": "m"}) == 5
    assert value("splitserve:routing_decisions_total", {"model_name": "m", "prefill": "local"}) == 1
