"""One reading of /proc/<pid>/stat, as a record.

The launcher (which process groups still live), the Ray component (is this pid still the
process we started), the engine placement (which children are vLLM's EngineCore), the benchmarks
(CPU seconds) and the lifeline tests all read this one line; they read it here, so the parse
that survives odd process names lives in one place.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str  # the process name, as the kernel cuts it (15 characters)
    state: str  # "R", "S", ... "Z" for a zombie
    ppid: int
    pgid: int
    session: int
    cpu_ticks: int  # user + system time of every thread so far, in clock ticks
    start_ticks: int  # start time after boot: tells a reused pid from the process we saw

    @property
    def alive(self) -> bool:
        """A zombie has exited and holds nothing; whoever adopted it reaps it when it can."""
        return self.state != "Z"

    @property
    def cpu_s(self) -> float:
        return self.cpu_ticks / os.sysconf("SC_CLK_TCK")


def parse(pid: int, line: str) -> ProcStat:
    # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses, so it is
    # cut at the first "(" and the last ")".
    comm = line[line.index("(") + 1:line.rindex(")")]
    f = line[line.rindex(")") + 2:].split()
    return ProcStat(pid=pid, comm=comm, state=f[0], ppid=int(f[1]), pgid=int(f[2]),
                    session=int(f[3]), cpu_ticks=int(f[11]) + int(f[12]), start_ticks=int(f[19]))


def proc_stat(pid: int) -> ProcStat | None:
    """The process's stat now; None once it is gone (or where there is no /proc)."""
    try:
        return parse(pid, (_PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError):  # ended meanwhile (or a half-read line of a dying process)
        return None


def all_procs() -> Iterator[ProcStat]:
    """Every process visible now (none where there is no /proc)."""
    if not _PROC.is_dir():
        return
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (st := proc_stat(int(entry.name))) is not None:
            yield st
