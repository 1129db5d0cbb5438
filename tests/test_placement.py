"""Serving processes are pinned off the engines' cores, and only when a core is left for them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from deploy.placement import ENGINE_CORE_NICE, engine_schedulers, free_cores, pin_serving

ALL = sorted(os.sched_getaffinity(0))


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


# A serving process with two children: one titled as vLLM's EngineCore titles itself, one not.
SERVER = """
import subprocess, sys, time
kid = "import sys, time; open('/proc/self/comm', 'w').write(sys.argv[1]); time.sleep(60)"
kids = [subprocess.Popen([sys.executable, "-c", kid, name])
        for name in ("VLLM::EngineCore", "VLLM::Worker")]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(60)
"""


@pytest.fixture
def server():
    p = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    core, runner = map(int, p.stdout.readline().split())
    yield p, core, runner
    for pid in (core, runner):
        os.kill(pid, 9)
    p.kill()
    p.wait()


def nice(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def test_free_cores_are_the_ones_no_engine_names() -> None:
    assert free_cores([]) == set(ALL)
    assert free_cores([str(ALL[0])]) == set(ALL[1:])
    assert free_cores([f"{ALL[0]}-{ALL[-1]}"]) == set()
    assert free_cores([",".join(map(str, ALL))]) == set()


@pytest.mark.skipif(len(ALL) < 2, reason="needs a core for the engine and one left over")
def test_pins_every_thread_of_the_serving_process_off_the_engine_core(child) -> None:
    assert pin_serving([child.pid], [str(ALL[0])]) == set(ALL[1:])
    for tid in os.listdir(f"/proc/{child.pid}/task"):
        assert os.sched_getaffinity(int(tid)) == set(ALL[1:])


def test_nothing_is_pinned_when_the_engines_take_every_core(child, monkeypatch) -> None:
    assert pin_serving([child.pid], [str(c) for c in ALL]) == set()
    assert os.sched_getaffinity(child.pid) == set(ALL)
    monkeypatch.setenv("SPLITSERVE_PIN_SERVING", "0")
    assert pin_serving([child.pid], []) == set()
    assert os.sched_getaffinity(child.pid) == set(ALL)


@pytest.mark.skipif(len(ALL) < 2, reason="needs a core for the engine and one left over")
def test_the_engine_core_scheduler_yields_to_the_serving_processes(server) -> None:
    """vLLM's EngineCore spins while its runner works: reniced, it takes no cycles the router or
    the worker servers want. Its affinity, and every other process, stay as they were."""
    proc, core, runner = server
    for _ in range(100):  # the children title themselves as they start
        if engine_schedulers([proc.pid]) == [core]:
            break
        time.sleep(0.05)
    assert engine_schedulers([proc.pid]) == [core]
    assert engine_schedulers([core]) == []  # only children of the given serving processes
    pin_serving([proc.pid], [str(ALL[0])])
    assert nice(core) == ENGINE_CORE_NICE
    assert os.sched_getaffinity(core) == set(ALL)
    assert (nice(proc.pid), nice(runner)) == (0, 0)
    assert os.sched_getaffinity(runner) == set(ALL)
