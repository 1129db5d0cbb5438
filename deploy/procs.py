"""Child processes running `splitserve` components: spawn, wait until ready, stop, leave nothing.

One launcher for `splitserve up`, the benchmarks and the end-to-end tests. Each child runs
`python -m deploy.cli SUBCOMMAND ...` in a process group of its own (so stopping it takes its vLLM
engine processes along) and writes a ready file — JSON with its endpoints — once it serves.
`stop()` sends SIGTERM to the workers first (they deregister and drain), then to the routers, and
SIGKILLs every group that is still there after the grace period.

Why a process group and not a session of its own: Linux shares CPU time fairly between sessions
first (autogroups, on by default), and a loaded vLLM CPU engine's model runner spins on
`sched_yield` between steps (vLLM's `SpinCondition`, a second after every message). A yield gives
way only to threads of the spinner's own session, so a process in another session gets only a
sliver of that core: a new engine beside a busy one loads far slower, and 1P+1D meets its SLO far
less often (figures: docs/benchmarks.md, "One session for the whole cluster"). In our session the
spin yields to every component.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.lifeline import PARENT_ENV
from splitserve.procstat import all_procs
from splitserve.roles import Role


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    ready_file: Path
    role: Role | None = None  # None: a router
    endpoints: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """The gRPC address (known once ready)."""
        return self.endpoints["grpc"]

    def signal(self, sig: int) -> None:
        """Signal the whole process group (the component and its engine processes)."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        """SIGTERM to the component alone: it drains, then stops its own engines. (To the whole
        group, the engines would die at once and fail the requests being drained.)"""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait()


class ProcessSet:
    def __init__(self, log_dir: Path | None = None, env: dict[str, str] | None = None,
                 own_sessions: bool = False) -> None:
        """`log_dir`: each child's output goes to NAME.log there (else to our own console).
        `own_sessions`: each child in a session of its own, the old way (for the benchmark
        that compares the two; see the module docstring)."""
        self.own_sessions = own_sessions
        self.dir = Path(tempfile.mkdtemp(prefix="splitserve-procs-"))  # ready files
        self.log_dir = log_dir
        self.env = env
        self.procs: list[Proc] = []

    def spawn(self, name: str, args: list[str], role: Role | None = None,
              module: str = "deploy.cli", env: dict[str, str] | None = None) -> Proc:
        """`module`: what `python -m` runs (a benchmark's stand-in takes the same flags).
        `env`: this child's environment instead of the set's (how secrets reach it: never
        in `args`, which every user of the host can read)."""
        ready = self.dir / name
        out = open(self.log_dir / f"{name}.log", "w") if self.log_dir else None
        try:
            # The child stops if we die, even by SIGKILL (splitserve/lifeline.py).
            base = env if env is not None else self.env if self.env is not None else os.environ
            env = {**base, PARENT_ENV: str(os.getpid())}
            # stdin: a child in a background group of a terminal's session that read it would
            # be stopped (SIGTTIN).
            p = subprocess.Popen([sys.executable, "-m", module, *args, "--ready-file",
                                  str(ready)], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT if out else None,
                                 **child_group(self.own_sessions))
        finally:
            if out is not None:
                out.close()  # the child has its own descriptor
        proc = Proc(name, p, ready, role)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        assert self.log_dir is not None, "children log to the console"
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def wait_ready(self, procs: Iterable[Proc] | None = None, timeout_s: float = 300.0) -> None:
        """Until each proc has written its ready file; raises if one dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        for p in procs if procs is not None else self.procs:
            while not (p.ready_file.exists() and p.ready_file.read_text()):
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited during start-up (exit "
                                       f"{p.popen.returncode}){self._tail(p)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{p.name} not ready after {timeout_s:.0f} s{self._tail(p)}")
                time.sleep(0.1)
            p.endpoints = json.loads(p.ready_file.read_text())

    def _tail(self, p: Proc) -> str:
        return f":\n{self.log(p.name)[-3000:]}" if self.log_dir else ""

    def tails(self, chars: int = 3000) -> str:
        """The end of each exited child's log, for an error message ("" when the children
        write to the console: it is already there)."""
        if self.log_dir is None:
            return ""
        return "".join(f"\n--- {p.name}: {self.log_dir / f'{p.name}.log'} ---\n"
                       f"{self.log(p.name)[-chars:]}"
                       for p in self.procs if p.popen.poll() is not None)

    def dead(self) -> list[str]:
        return [f"{p.name} (exit {p.popen.returncode})" for p in self.procs
                if p.popen.poll() is not None]

    def stop(self, grace_s: float = 30.0) -> None:
        # Workers first (they drain through the routers), then the routers.
        self.stop_some([p for p in self.procs if p.role is not None], grace_s)
        self.stop_some([p for p in self.procs if p.role is None], grace_s)
        for p in self.procs:  # whatever is left, and the engine children of everyone
            p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def stop_some(procs: list[Proc], grace_s: float = 30.0) -> None:
        """SIGTERM each, wait up to `grace_s` for them all, then SIGKILL each whole group."""
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.popen.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            p.kill()

    def survivors(self) -> list[str]:
        """Names of children whose group still has a live process (engines included)."""
        groups = live_groups()
        return [p.name for p in self.procs if p.popen.pid in groups]


def child_group(own_session: bool = False) -> dict:
    """Popen's arguments for a child that leads a process group of its own, in our session
    (see the module docstring) unless `own_session`."""
    return {"start_new_session": True} if own_session else {"process_group": 0}


def live_groups() -> set[int]:
    """The process groups (and sessions: a session's leader leads a group of the same id)
    that have a live process."""
    return {p.pgid for p in all_procs() if p.alive}
