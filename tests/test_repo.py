"""Repository contracts: README commands, CI entry point, lint (layering: test_layering.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return [ln.strip() for ln in lines[:40] if ln.startswith(("scripts/", "./scripts/"))]


def test_readme_opens_with_run_and_test_commands() -> None:
    cmds = _readme_commands()
    assert len(cmds) >= 2, cmds
    assert cmds[0].startswith("scripts/setup.sh && ") and "splitserve" in cmds[0]
    assert cmds[1] == "scripts/test.sh"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"exec {_readme_commands()[1]}" in ci


def test_ruff_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]
