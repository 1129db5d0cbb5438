"""The session-end report of vLLM's shared-memory segments (tests/conftest.py): it finds a
segment whose process group was SIGKILLed (resource tracker included) and not a mapped one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing import shared_memory

from tests.conftest import orphaned_psm_segments


def test_an_unmapped_segment_of_a_killed_group_is_found_and_a_mapped_one_is_not() -> None:
    since = time.time() - 1
    live = shared_memory.SharedMemory(create=True, size=4096)
    code = ("from multiprocessing import shared_memory; import time; "
            "m = shared_memory.SharedMemory(create=True, size=4096); "
            "print(m.name, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    name = proc.stdout.readline().strip()
    try:
        assert f"/dev/shm/{name}" not in orphaned_psm_segments(since)  # still mapped
        os.killpg(proc.pid, signal.SIGKILL)  # the resource tracker too
        proc.wait(10)
        deadline = time.monotonic() + 10
        while f"/dev/shm/{name}" not in (found := orphaned_psm_segments(since)):
            assert time.monotonic() < deadline, f"{name} not found: {found}"
            time.sleep(0.1)
        assert f"/dev/shm/{live.name}" not in found
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass
        live.close()
        live.unlink()
