"""The KV transfer benchmark runs end to end and reports every column (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("pair_channel_gbps", "tcp_loopback_gbps", "memcpy_gbps", "connector_gbps",
          "connector_shm_gbps", "pair_vs_tcp", "shm_vs_pair")


@pytest.mark.budget(20)  # a producer process and transfers up to its largest size
def test_kv_transfer_bench_reports_one_positive_row(tmp_path: Path) -> None:
    out = tmp_path / "kv_transfer.json"
    proc = subprocess.run(
        [sys.executable, "bench/kv_transfer.py", "--sizes-mb", "1", "--repeats", "2",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["repeats"] == 2 and report["machine"]["cpu_count"] >= 1
    (row,) = report["rows"]
    assert row["size_mb"] == 1
    for field in FIELDS:
        assert row[field] > 0, (field, row)
