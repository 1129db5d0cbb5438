"""The router throughput benchmark runs end to end over both APIs (no timing assertions)."""

from __future__ import annotations

from pathlib import Path

from bench.router_throughput import measure


def test_router_throughput_counts_every_streamed_token(tiny_model_dir: Path) -> None:
    rows = measure(str(tiny_model_dir), [3], seconds=0.5, tokens_per_request=40)
    assert [(t.api, t.concurrency) for t in rows] == [("grpc", 3), ("http", 3)]
    for t in rows:
        # Whole requests only (the closed loop runs at least one per stream): every token of
        # every request reached the client, and the router's CPU time was read.
        assert t.tokens > 0 and t.tokens % 40 == 0, t
        assert t.router_cpu_s > 0 and t.wall_s > 0, t
