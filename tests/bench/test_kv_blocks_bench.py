"""The KV block-copy benchmark runs in both of vLLM's memory orders, checks its copies bit-exact
and reports every column (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kv_blocks import COLUMNS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_kv_blocks_bench_reports_a_positive_row(tmp_path: Path, layout: str) -> None:
    out = tmp_path / "kv_blocks.json"
    proc = subprocess.run(
        [sys.executable, "bench/kv_blocks.py", "--tokens", "300", "--repeats", "1",
         "--device", "cpu", "--layout", layout, "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]  # includes the bit-exact checks
    report = json.loads(out.read_text())
    assert report["strided"] is (layout == "strided")
    (row,) = report["rows"]
    assert row["tokens"] == 300 and row["blocks"] == (19 if layout == "strided" else 3)
    for column in COLUMNS:
        assert row[column] > 0, (column, row)
