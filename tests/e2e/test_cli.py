"""The README's run command, as written (minus the setup step, and on a free port)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from splitserve.net import free_port
from tests.test_repo import ROOT, _readme_commands

pytestmark = pytest.mark.slow


def test_readme_run_command_starts_a_cluster_and_answers(tmp_path) -> None:
    run = _readme_commands()[0].split("&&", 1)[1].strip()
    argv = shlex.split(run)
    assert argv[0] == ".venv/bin/splitserve" and argv[1] == "up"
    env_cache = {"SPLITSERVE_CACHE_DIR": str(tmp_path)}  # the default model is generated anew
    out = subprocess.run([sys.executable, "-m", "deploy.cli", *argv[1:], "--grpc-port",
                          str(free_port()), "--http-port", "0"], cwd=ROOT,
                         capture_output=True, text=True,
                         timeout=600, env={**os.environ, **env_cache})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "no completion text on stdout"
    assert "[splitserve] ready in" in out.stderr
    assert "completion tokens" in out.stderr  # the client's summary line: the request finished
    assert (tmp_path / "models" / "tiny-seed0" / "config.json").exists()
