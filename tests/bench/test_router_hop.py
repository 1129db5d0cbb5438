"""The router-hop benchmark runs all three paths at each prompt length (no timing assertions)."""

from __future__ import annotations

from pathlib import Path

from bench.router_hop import PATHS, measure


def test_router_hop_times_every_path_at_every_length(tiny_model_dir: Path) -> None:
    rows = measure(str(tiny_model_dir), [3, 300], rounds=4, warmup=1)
    assert [r["prompt_len"] for r in rows] == [3, 300]
    for r in rows:
        # A path that did not stream a token back fails inside measure(); here every path's
        # first token was timed.
        assert set(r["ttft_ms"]) == set(PATHS) and min(r["ttft_ms"].values()) > 0, r
        assert r["rounds"] == 4


def test_a_baseline_checkout_runs_beside_the_router(tiny_model_dir: Path) -> None:
    """`--baseline DIR`: a second router, run from DIR's code, in the same rotation. This
    checkout stands in for the other one."""
    root = Path(__file__).resolve().parents[2]
    (row,) = measure(str(tiny_model_dir), [3], rounds=3, warmup=1, baseline=str(root))
    assert set(row["ttft_ms"]) == {*PATHS, "baseline"} and min(row["ttft_ms"].values()) > 0
    assert "router_over_baseline_ms" in row and "baseline_adds_ms" in row
