"""Children die with their parent, even when it is SIGKILLed: the components `splitserve up`
starts, and the vLLM engine process each worker starts (splitserve/lifeline.py)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.procstat import all_procs, proc_stat
from tests.e2e.cluster import ROOT, ProcCluster

pytestmark = pytest.mark.slow

# The parent: what `up` does (deploy/procs.py), a router and one colocated worker, then it waits.
PARENT = """
import json, sys, time
from tests.e2e.cluster import ProcCluster
from splitserve.roles import Role
cl = ProcCluster(sys.argv[1])
r = cl.router("R")
cl.wait_ready([r], 120)
w = cl.worker("W", Role.COLOCATED, 1, "--router", r.address)
cl.wait_ready([w], 300)
print(json.dumps({"router": r.popen.pid, "worker": w.popen.pid}), flush=True)
time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st.alive


def _children(pid: int) -> list[int]:
    return [p.pid for p in all_procs() if p.ppid == pid]


def _descendants(pid: int) -> list[int]:
    out = _children(pid)
    for child in list(out):
        out += _descendants(child)
    return out


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_components_and_engines_die_with_a_sigkilled_parent(tiny_model_dir: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_model_dir)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    pids: dict[str, int] = {}
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 420)
        assert ready, "the parent never reported its cluster ready"
        pids = json.loads(parent.stdout.readline())
        engines = _children(pids["worker"])
        assert engines, "the worker has no engine process"
        # The worker alone, as the OOM killer would: its engine must not outlive it. (Before
        # lifeline.py it did, holding its share of host memory and its cores.)
        os.kill(pids["worker"], signal.SIGKILL)
        assert not _wait_gone(engines, 20), "the engine outlived its SIGKILLed worker"
        # Then `up` itself, as a supervisor does after its grace period: the router must go
        # too (it drains first) instead of keeping its ports as an orphan.
        os.kill(parent.pid, signal.SIGKILL)
        assert not _wait_gone([pids["router"]], 45), "the router outlived its SIGKILLed parent"
    finally:
        for pid in (parent.pid, *pids.values()):
            try:
                os.killpg(pid, signal.SIGKILL)  # each child leads a process group of its own
            except (ProcessLookupError, PermissionError):
                pass
        parent.wait()


def test_components_and_engines_run_in_our_session(cl: ProcCluster) -> None:
    """Each component leads a process group of its own, so that stopping it takes its engine
    along, and stays in the launcher's session: Linux shares CPU time between sessions first,
    and a busy engine's spinning wait yields only inside its own (deploy/procs.py)."""
    engines = 0
    live = [p for p in cl.procs if p.popen.poll() is None]  # earlier tests retire their own
    assert {"A", "P0", "D0", "C"} <= {p.name for p in live}
    for p in live:
        pid = p.popen.pid
        assert (os.getpgid(pid), os.getsid(pid)) == (pid, os.getsid(0)), p.name
        for child in _descendants(pid):
            assert (os.getpgid(child), os.getsid(child)) == (pid, os.getsid(0)), p.name
            engines += p.role is not None
    assert engines >= 2 * sum(p.role is not None for p in live)  # EngineCore and runner
