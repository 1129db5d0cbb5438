"""Serving processes are pinned off the engines' cores, and only when a core is left for them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deploy.placement import free_cores, pin_serving

ALL = sorted(os.sched_getaffinity(0))


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


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


def test_nothing_is_pinned_when_the_engines_take_every_core(child) -> None:
    assert pin_serving([child.pid], [str(c) for c in ALL]) == set()
    assert os.sched_getaffinity(child.pid) == set(ALL)
