"""vLLM's EngineCore process on a CPU host, and why it runs at a lower priority.

On CPU, vLLM runs every engine as three processes: ours (AsyncLLM, the worker server), its
EngineCore child (the scheduler), and the EngineCore's model-runner child (the forward passes,
bound to the engine's cores). While the runner computes a step, the EngineCore waits for its
answer in `SpinCondition.wait`, spinning on `sched_yield` for a second after every message:
under load it never stops. At the same priority as everything else that spin took the CPU the
router and worker servers needed (their event loops stalled for up to half a second, which
became TTFT), and with one engine per core it took the other engine's runner's cycles too.

So once an engine is up its worker renices the EngineCore to `ENGINE_CORE_NICE` (every thread:
Linux niceness is per thread). It still spins when a core is idle and still does its real work
(scheduling a step takes a millisecond or two); it just yields at once to any process at normal
priority, so the servers' event loops get the core when they need it (figures: docs/benchmarks.md,
"The engine's scheduler process"). `--engine-core-nice 0` (EngineConfig.engine_core_nice)
leaves it as vLLM starts it. GPU engines run their model in the EngineCore itself and are left
alone. How long those waits spin at all is splitserve/engine_spin.py's business: 2 ms, not a
second, in our workers' engines.
"""

from __future__ import annotations

import logging
import os

from splitserve.procstat import all_procs

log = logging.getLogger(__name__)

ENGINE_CORE_NICE = 10
ENGINE_CORE_TITLE = "VLLM::EngineCor"  # vLLM's process title, as /proc/<pid>/comm cuts it


def engine_cores(parents: list[int]) -> list[int]:
    """The EngineCore processes that are children of `parents` (none without /proc)."""
    wanted = set(parents)
    return [p.pid for p in all_procs() if p.comm == ENGINE_CORE_TITLE and p.ppid in wanted]


def place_threads(pids: list[int], cores: set[int] | None, nice: int | None = None) -> None:
    """Set the affinity (unless None) and the niceness (unless None) of every current thread of
    `pids` (Linux keeps both per thread)."""
    for pid in pids:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone, or no /proc (not Linux): nothing to place
            continue
        for tid in map(int, threads):
            try:
                if cores is not None:
                    os.sched_setaffinity(tid, cores)
                if nice is not None:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:  # a thread that just ended
                pass


def lower_engine_core(nice: int = ENGINE_CORE_NICE) -> list[int]:
    """Renice this process's EngineCore children (see the module docstring); their pids."""
    pids = engine_cores([os.getpid()]) if nice else []
    place_threads(pids, None, nice)
    if pids:
        log.info("engine core process(es) %s at nice %+d", pids, nice)
    return pids
