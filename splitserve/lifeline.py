"""A process that outlives its parent stops: children of `splitserve up` (and of the tests and
benchmarks) and the vLLM engine processes of each worker, even when the parent dies by SIGKILL.

Lifecycle: a parent that wants this names itself in an environment variable before it starts the
child (`PARENT_ENV` for components, set by deploy/procs.py; `ENGINE_PARENT_ENV` for engines, set by
the worker before it starts vLLM). The child calls `hold(var, grace_s)` early: if the variable names
its parent, a daemon thread watches for the parent to go — the child is then re-parented, so
`getppid()` changes — and sends the child SIGTERM (a component drains and stops its engines), then
SIGKILL after `grace_s`. Engines load `engine_plugin` through vLLM's `vllm.general_plugins` entry
point (pyproject.toml), with no grace: a worker's engine has nothing to hand over once the worker
is gone.

Why a watching thread rather than PR_SET_PDEATHSIG: the kernel sends that signal when the parent
*thread* ends, and workers start vLLM from a thread-pool thread; a thread that ended would take
a healthy engine with it. Polling getppid() costs nothing and is independent of threads.
"""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT_ENV = "SPLITSERVE_PARENT_PID"
ENGINE_PARENT_ENV = "SPLITSERVE_ENGINE_PARENT_PID"
POLL_S = 0.2


def hold(var: str = PARENT_ENV, grace_s: float = 45.0) -> bool:
    """Stop this process when the parent named in `var` is gone; True if armed. A variable that
    names another process (inherited by a grandchild, or our own pid) arms nothing."""
    try:
        parent = int(os.environ.get(var, ""))
    except ValueError:
        return False
    if parent != os.getppid():
        return False
    threading.Thread(target=_watch, args=(parent, grace_s), name="splitserve-lifeline",
                     daemon=True).start()
    return True


def _watch(parent: int, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    if grace_s > 0:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


def engine_plugin() -> None:
    """vLLM general plugin: loaded in every vLLM process, armed only in a worker's engine (whose
    parent set ENGINE_PARENT_ENV). Processes the engine starts in turn (GPU executor workers)
    are re-pointed at it, so each level watches its own parent."""
    if hold(ENGINE_PARENT_ENV, grace_s=0.0):
        os.environ[ENGINE_PARENT_ENV] = str(os.getpid())
