"""Where the serving processes run on a small host, relative to the engines' cores.

`splitserve up` gives each engine a core of its own (`splitserve.engine.spread_cores`). The
router's and the workers' own event loops (gRPC, HTTP, detokenisation) are then pinned to the
cores no engine uses, once the engines are up: left to the scheduler they also run on the
engines' cores and take time slices from the model's threads. Measured on a 2-core host, one
colocated worker at 2 req/s (bench/placement.py, docs/benchmarks.md "Placement"): pinned
served twice the SLO attainment of free on average, winning 3 of 4 rounds.

Only the serving processes' own threads are pinned, after their engines have started: vLLM's
engine processes are children of a worker and bind their compute threads themselves. One of them
is handled apart: vLLM's EngineCore (the scheduler between a worker server and its model runner)
waits for each step by spinning on sched_yield, so under load it takes every free cycle of the
serving cores, and the router and worker servers, pinned there, were kept waiting behind it:
their event loops stalled for up to half a second under 2 req/s, which became TTFT (measured with
per-request timestamps, docs/benchmarks.md "Placement"). It is reniced to ENGINE_CORE_NICE: it
still spins when nobody else wants the core, and yields it at once to the serving processes.
Nothing is pinned when the engines take every core (nothing would be left to pin to) or with
SPLITSERVE_PIN_SERVING=0.
"""

from __future__ import annotations

import os

# The EngineCore's niceness next to the serving processes (0): see the module docstring.
ENGINE_CORE_NICE = 10
_ENGINE_CORE = "VLLM::EngineCor"  # its process title, as /proc/<pid>/comm cuts it (15 bytes)


def free_cores(engine_cores: list[str]) -> set[int]:
    """Cores of this process's affinity that no engine's core list ("0", "2-3", "0,4") names."""
    used: set[int] = set()
    for spec in engine_cores:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            if lo.strip().isdigit():
                used.update(range(int(lo), int(hi or lo) + 1))
    return set(os.sched_getaffinity(0)) - used


def pin_serving(pids: list[int], engine_cores: list[str]) -> set[int]:
    """Pin every thread of `pids` (not their children) to the free cores; returns those cores
    (empty: nothing pinned)."""
    cores = free_cores(engine_cores)
    if not cores or os.environ.get("SPLITSERVE_PIN_SERVING", "1") == "0":
        return set()
    place_threads(pids, cores)
    place_threads(engine_schedulers(pids), None, ENGINE_CORE_NICE)
    return cores


def engine_schedulers(pids: list[int]) -> list[int]:
    """vLLM's EngineCore processes among the children of `pids`."""
    parents = set(pids)
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        if name == _ENGINE_CORE and int(rest.split()[1]) in parents:
            found.append(int(entry))
    return found


def place_threads(pids: list[int], cores: set[int] | None, nice: int | None = None) -> None:
    """Set the affinity (unless None) and the niceness (unless None) of every current thread of
    `pids`."""
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
