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


# What this test can hold the planner to on a shared 2-core host running five engines: the same
# order of magnitude -- predicted median TTFT and TPOT within a factor of PLAN_FACTOR of the
# measured ones, plus PLAN_ABS_MS. The profile's per-sequence step cost and overhead are fitted
# from two short runs, and CPU contention moves them by tens of percent from run to run (one
# profile predicted a 75 ms median TPOT for a measured 25 ms; the same 3 req/s run measured a
# median TTFT of 50 ms once and 88 ms another time). How close the planner is on a quiet host is
# a benchmark's question (docs/benchmarks.md), not a test's: no timing asserts in tests.
PLAN_FACTOR, PLAN_ABS_MS = 4.0, 20.0


def test_planner_agrees_with_a_measured_run(cl: ProcCluster, tiny_model_dir: Path,
                                            tmp_path: Path) -> None:
    from bench.metrics import SLO
    from bench.planner import load_profile_from_results, load_rows, simulate

    b = cl.by_name["B"]  # 1 prefill + 1 decode
    common = ["--router", b.address, "--model", str(tiny_model_dir), "--input-len",
              "uniform:32-400", "--output-len", "uniform:16-48", "--no-progress"]
    # Profile: two open-loop runs at rates below and above the one we predict. (Profiled closed
    # loop at concurrency 1, the prefills measured 5-10x slower than what the same workers then
    # sustained under load, and the planner predicted a queue that never formed.)
    for i, r in enumerate((1.5, 5.0)):
        asyncio.run(bench(_args(*common, "--num-prompts", "24", "--rate", str(r),
                                "--seed", str(i), "--result-json", str(tmp_path / f"p{i}.json"))))
    profile = load_profile_from_results([tmp_path / "p0.json", tmp_path / "p1.json"])
    # Measured: open loop at a moderate Poisson rate, another seed. Moderate means well below
    # what the profile says the pair sustains: near saturation the predicted queue, and so TPOT,
    # is steep in the fitted per-sequence step cost, which this shared host measures with tens of
    # percent of noise (at 3 req/s one CI run predicted 75 ms for a measured 25 ms; the same
    # profile predicts ~31 ms at 2 req/s).
    rate = 2.0
    out = asyncio.run(bench(_args(*common, "--num-prompts", "40", "--rate", str(rate),
                                  "--seed", "9", "--result-json", str(tmp_path / "m.json"))))
    measured = out["runs"][0]
    workload = [(r["prompt_tokens"], r["output_tokens"]) for r in load_rows([tmp_path / "m.json"])]
    sim = simulate(profile, 1, 1, rate, workload, SLO(), seed=0, num_requests=2000)
    for name, pred in (("ttft", sim.ttft_ms.p50), ("tpot", sim.tpot_ms.p50)):
        meas = measured[f"median_{name}_ms"]
        print(f"planner vs measured median {name}: {pred:.2f} vs {meas:.2f} ms")
        assert meas / PLAN_FACTOR - PLAN_ABS_MS <= pred <= meas * PLAN_FACTOR + PLAN_ABS_MS, (
            f"planner median {name} {pred:.2f} ms vs measured {meas:.2f} ms; profile {profile}")
