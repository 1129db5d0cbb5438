"""Shared-memory KV segments outliving their creator: the resource tracker for a lone killed
process, the sweep (shm.sweep_orphans) for a killed process group. Real processes and /dev/shm,
no transfers (those are in test_transport.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bench.kv_producer import ROOT
from splitserve.kv import shm


def test_a_sigkilled_consumer_leaves_no_segment() -> None:
    """The segment is created through multiprocessing's shared memory, whose resource tracker
    unlinks what a dead process left behind."""
    code = ("import os, signal, sys; from splitserve.kv.transport.shm import ConsumerStaging; "
            "s = ConsumerStaging(); print(s.segment.name, flush=True); sys.stdin.readline(); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    name = proc.stdout.readline().strip()
    assert name in shm.leftover_segments()
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while name in shm.leftover_segments():
        assert time.monotonic() < deadline, f"{name} outlived its SIGKILLed creator"
        time.sleep(0.05)


def test_segments_of_a_killed_process_group_are_swept_and_live_ones_kept() -> None:
    """SIGKILL to the whole group takes the resource tracker too, and the segment stays; the
    next process to make a segment sweeps it, and leaves alone the ones a live process holds
    (however old) and young ones (their creator may not hold its lock yet)."""
    code = ("from splitserve.kv.transport.shm import ConsumerStaging; import sys; "
            "s = ConsumerStaging(); print(s.segment.name, flush=True); sys.stdin.readline()")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True)
    dead = proc.stdout.readline().strip()
    os.killpg(proc.pid, signal.SIGKILL)  # its resource tracker with it
    assert proc.wait(10) == -signal.SIGKILL
    time.sleep(0.5)
    assert dead in shm.leftover_segments()  # the leak the sweep is for
    live = shm.Segment.create(1 << 20)
    young = shm.PREFIX + "f" * 24
    open(os.path.join("/dev/shm", young), "wb").close()
    old = time.time() - 2 * shm.ORPHAN_MIN_AGE_S
    try:
        for name in (dead, live.name):
            os.utime(os.path.join("/dev/shm", name), (old, old))
        removed = shm.sweep_orphans()  # may also take orphans of earlier runs on this host
        assert dead in removed and live.name not in removed and young not in removed
        assert {live.name, young} <= set(shm.leftover_segments())
        assert dead not in shm.leftover_segments()
    finally:
        live.close()
        os.unlink(os.path.join("/dev/shm", young))
        if dead in shm.leftover_segments():
            os.unlink(os.path.join("/dev/shm", dead))
