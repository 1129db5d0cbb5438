"""Where the serving processes run on a small host, relative to the engines' cores.

`splitserve up` gives each engine a core of its own (`splitserve.engine.spread_cores`). The
router's and the workers' own event loops (gRPC, HTTP, detokenisation) are then pinned to the
cores no engine uses, once the engines are up: left to the scheduler they also run on the
engines' cores and take time slices from the model's threads, which shows as missed SLOs
(bench/placement.py; figures: docs/benchmarks.md, "Placement of the serving processes").

Only the serving processes' own threads are pinned, after their engines have started: vLLM's
engine processes are children of a worker and bind their compute threads themselves, so they are
left where they are (each worker lowers its EngineCore's priority itself, wherever it runs:
splitserve/engine_core.py). Nothing is pinned when the engines take every core (nothing would be
left to pin to) or with `up --no-pin-serving`.
"""

from __future__ import annotations

import os

from splitserve.engine_core import place_threads


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
    if not cores:
        return set()
    place_threads(pids, cores)
    return cores
