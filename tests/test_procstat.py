"""The one reader of /proc/<pid>/stat (splitserve/procstat.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from splitserve.procstat import all_procs, parse, proc_stat

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")


def test_a_name_with_spaces_and_parentheses_does_not_shift_the_fields() -> None:
    # The fields after the name as the kernel writes them: state ppid pgrp session tty tpgid
    # flags minflt cminflt majflt cmajflt utime stime ... starttime (field 22).
    rest = "S 10 20 30 0 -1 0 0 0 0 0 7 5 0 0 20 0 1 0 4242 0"
    st = parse(99, f"99 (a) b (c) {rest}")
    assert (st.comm, st.state, st.ppid, st.pgid, st.session) == ("a) b (c", "S", 10, 20, 30)
    assert (st.cpu_ticks, st.start_ticks) == (12, 4242)


def test_this_process_and_a_child_as_the_kernel_reports_them() -> None:
    me = proc_stat(os.getpid())
    assert me is not None and me.alive
    assert (me.ppid, me.pgid, me.session) == (os.getppid(), os.getpgid(0), os.getsid(0))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in {p.pid for p in all_procs() if p.ppid == os.getpid()}
    finally:
        child.kill()
    deadline = time.monotonic() + 10
    while (st := proc_stat(child.pid)) is not None and st.alive:  # killed, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert st is not None and st.state == "Z"  # a zombie: gone for us, still listed
    child.wait()
    assert proc_stat(child.pid) is None
