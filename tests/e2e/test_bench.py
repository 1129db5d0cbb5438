"""`splitserve bench` against the shared e2e cluster: a short real run writes JSON and PNGs."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import pytest

from bench.metrics import max_goodput_rate
from bench.run import add_arguments, bench
from splitserve.slo import SLO
from tests.e2e.cluster import ProcCluster
from tests.e2e.conftest import registered

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
                 "fixed:8", "--rate", "50,inf", "--slo", "ttft=5s,tpot=1s",
                 "--result-json", str(tmp_path / "r.json"), "--plot-dir", str(tmp_path),
                 "--no-progress", "--label", protocol)
    out = asyncio.run(bench(args))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["runs"] and len(saved["runs"]) == 2
    slo = SLO(ttft_s=5.0, tpot_s=1.0)
    assert [run["rate"] for run in saved["runs"]] == [50.0, float("inf")]
    for run in saved["runs"]:
        assert run["completed"] == 12 and run["failed"] == 0
        assert run["total_output_tokens"] == 12 * 8  # ignore_eos: lengths are controlled
        assert run["mean_ttft_ms"] > 0 and run["request_throughput"] > 0
        rows = run["requests"]
        assert len(rows) == 12 and all(r["ok"] and r["output_tokens"] == 8 for r in rows)
        # The attainment is what the per-request rows say against the SLO (not a timing
        # assert: whether a request met it is the host's business, the arithmetic is ours).
        met = sum(slo.meets_times(r["ok"], r["ttft_s"], r["tpot_s"], r["e2e_s"]) for r in rows)
        assert run["slo_attainment"] == met / 12
    points = [(run["rate"], run["slo_attainment"]) for run in saved["runs"]]
    assert out["goodput_rate"] == max_goodput_rate(points)  # the default 90% target
    assert saved["num_prefill_workers"] == registered(cl, "A")[0]
    for png in ("attainment_vs_rate.png", "latency_cdf.png", "breakdown.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


# The planner on real bench output. What this test holds: a real cluster's result JSON carries
# every field the planner fits from, those fields are consistent with each other, the fit gives a
# usable profile, and the simulation answers for the measured workload. It does not hold the
# prediction to the measured latencies: that is a timing assert, and on a shared 2-core host
# running five engines it failed CI twice (a profile fitted during contention predicted 287 s for a
# measured 69 ms). How close the planner comes is a benchmark's question: docs/benchmarks.md.
def test_planner_fits_and_simulates_a_measured_run(cl: ProcCluster, tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
    from splitserve.planner import load_profile_from_results, load_rows, simulate

    b = cl.by_name["B"]  # 1 prefill + 1 decode
    common = ["--router", b.address, "--model", str(tiny_model_dir), "--input-len",
              "uniform:32-400", "--output-len", "uniform:16-48", "--no-progress"]
    # Open loop at two rates, so the fit sees two decode batch sizes (profile at the load you plan
    # for: closed loop at concurrency 1 measures prefills 5-10x slower than under load).
    paths = [tmp_path / f"p{i}.json" for i in range(2)]
    outs = [asyncio.run(bench(_args(*common, "--num-prompts", "24", "--rate", str(r),
                                    "--seed", str(i), "--result-json", str(path))))
            for i, (r, path) in enumerate(zip((1.5, 5.0), paths))]
    rows = load_rows(paths)
    assert len(rows) == 48 and all(r["ok"] for r in rows)
    for r in rows:  # what the prefill worker reports, per request, and how it adds up
        assert r["batch"] >= 1.0
        assert r["queue_s"] >= 0.0 and r["prefill_s"] > 0.0 and r["tpot_s"] > 0.0
        # engine queue + compute happen inside the client's TTFT (one host, one clock: 1 ms slack)
        assert r["queue_s"] + r["prefill_s"] <= r["ttft_s"] + 1e-3, r
    profile = load_profile_from_results(paths)
    values = profile.to_dict().values()
    assert all(math.isfinite(v) and v >= 0.0 for v in values), profile
    assert profile.prefill_s(400) > 0.0 and profile.step_s(1) > 0.0, profile
    workload = [(r["prompt_tokens"], r["output_tokens"]) for r in rows]
    sim = simulate(profile, 1, 1, 2.0, workload, SLO(), seed=0, num_requests=500)
    assert 0.0 <= sim.attainment <= 1.0
    assert math.isfinite(sim.ttft_ms.p50) and math.isfinite(sim.tpot_ms.p50), sim
    # The floor: no simulated TTFT beats the fitted service time of the shortest prompt.
    assert sim.ttft_ms.p50 >= 1e3 * (profile.prefill_s(32) + profile.overhead_s) - 1e-6
    for name in ("ttft", "tpot"):  # for the log, not an assert
        meas = [o["runs"][0][f"median_{name}_ms"] for o in outs]
        print(f"planner median {name} at 2 req/s: {getattr(sim, name + '_ms').p50:.2f} ms; "
              f"measured at 1.5 / 5 req/s: {meas[0]:.2f} / {meas[1]:.2f} ms")
