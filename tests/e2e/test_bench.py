"""`splitserve bench` against the shared e2e cluster: a short real run writes JSON and PNGs."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from bench.run import add_arguments, bench
from tests.e2e.cluster import ProcCluster

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leak_check")]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_short_sweep_writes_json_and_plots(cl: ProcCluster, tiny_model_dir: Path,
                                           tmp_path: Path, protocol: str) -> None:
    a = cl.by_name["A"]
    target = (["--http-url", a.endpoints["http"]] if protocol == "http" else [])
    args = _args("--router", a.address, *target, "--model", str(tiny_model_dir),
                 "--num-prompts", "12", "--input-len", "uniform:8-300", "--output-len",
                 "fixed:8", "--rate", "50,inf", "--slo", "ttft=5000,tpot=1000",
                 "--result-json", str(tmp_path / "r.json"), "--plot-dir", str(tmp_path),
                 "--no-progress", "--label", protocol)
    out = asyncio.run(bench(args))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["runs"] and len(saved["runs"]) == 2
    for run in saved["runs"]:
        assert run["completed"] == 12 and run["failed"] == 0
        assert run["total_output_tokens"] == 12 * 8  # ignore_eos: lengths are controlled
        assert run["mean_ttft_ms"] > 0 and run["request_throughput"] > 0
        assert 0.0 <= run["slo_attainment"] <= 1.0
        assert len(run["requests"]) == 12
    assert out["goodput_rate"] in (50.0, float("inf"), None)
    assert saved["num_prefill_workers"] == 2
    for png in ("attainment_vs_rate.png", "latency_cdf.png", "breakdown.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
