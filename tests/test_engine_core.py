"""A CPU engine's EngineCore (vLLM's scheduler process, which spins while its runner computes)
runs below normal priority, so its spin yields to the servers; nothing else is touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from splitserve.engine_core import ENGINE_CORE_NICE, engine_cores, lower_engine_core

# A child that titles itself as vLLM titles its processes (/proc/<pid>/comm keeps 15 bytes).
KID = "import sys, time; open('/proc/self/comm', 'w').write(sys.argv[1]); time.sleep(60)"


@pytest.fixture
def engine_children():
    kids = [subprocess.Popen([sys.executable, "-c", KID, name])
            for name in ("VLLM::EngineCore", "VLLM::Worker")]
    deadline = time.monotonic() + 10
    # They title themselves as they start. (Other engine cores of this process may exist: a
    # suite that ran engines in it. Only ours are asserted on.)
    while kids[0].pid not in engine_cores([os.getpid()]):
        assert time.monotonic() < deadline, f"the child never took its title: {_titles(kids)}"
        time.sleep(0.05)
    yield kids
    for k in kids:
        k.kill()
        k.wait()


def _titles(kids: list[subprocess.Popen]) -> list[str]:
    out = []
    for k in kids:
        try:
            with open(f"/proc/{k.pid}/comm") as f:
                out.append(f.read().strip())
        except OSError as e:
            out.append(repr(e))
    return out


def nice(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def test_only_the_engine_core_child_is_found(engine_children) -> None:
    core, runner = engine_children
    found = engine_cores([os.getpid()])
    assert core.pid in found and runner.pid not in found
    assert engine_cores([runner.pid]) == []  # children of the given processes only


def test_the_engine_core_is_reniced_and_nothing_else(engine_children) -> None:
    core, runner = engine_children
    mine = nice(os.getpid())
    lowered = lower_engine_core()
    assert core.pid in lowered and runner.pid not in lowered
    assert nice(core.pid) == ENGINE_CORE_NICE
    for tid in os.listdir(f"/proc/{core.pid}/task"):  # niceness is per thread on Linux
        assert nice(int(tid)) == ENGINE_CORE_NICE
    assert (nice(runner.pid), nice(os.getpid())) == (mine, mine)


def test_the_setting_turns_it_off(engine_children) -> None:
    core, _ = engine_children
    assert lower_engine_core(nice=0) == []
    assert nice(core.pid) == nice(os.getpid())
