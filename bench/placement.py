"""Where splitserve's serving processes should run on a small host: measured, not guessed.

One colocated-1 deployment (as bench/vs_vllm.py starts it: engine on --engine-cores), driven by
`vllm bench serve` at one rate; between drives the router's and the worker server's threads, and
vLLM's EngineCore process (the scheduler between the worker server and its model runner, which
spins while it waits for a step), are re-placed, the order rotating each round:
  free          serving processes on all cores, the scheduler's choice; EngineCore as vLLM left it
  pinned        serving processes on the cores the engine does not use; EngineCore as left
  niced         serving processes on all cores at nice +10, so the engine wins contended slices
  core-niced    pinned, and the EngineCore at nice +10 (what every worker now does on CPU,
                splitserve/engine_core.py)
  core-beside   pinned, and the EngineCore on the engine's own cores, beside its model runner

    python bench/placement.py [--model DIR] [--rate 2] [--rounds 3] [--num-prompts 40]
                              [--variants pinned,core-niced,core-beside]

Prints each drive and the per-placement mean attainment and median TTFT/TPOT medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench.vs_vllm import drive, start_splitserve
from deploy.placement import free_cores
from deploy.procs import ProcessSet
from splitserve.engine_core import ENGINE_CORE_NICE, engine_cores, place_threads
from splitserve.models import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="default: the generated tiny model")
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=20000)
    ap.add_argument("--variants", default="pinned,core-niced,core-beside")
    a = ap.parse_args()
    # The workload and engine settings of bench/vs_vllm.py.
    cfg = argparse.Namespace(engine_cores="0", dtype="float32", max_model_len=4096,
                             kv_cache_mib=256, splitserve_port=8200, input_len=1536,
                             output_len=128, range_ratio=0.333, num_prompts=a.num_prompts,
                             slo_ttft_s=1.0, slo_tpot_s=0.025, stream_interval=1)
    model = resolve_model(a.model)
    tmp = Path(tempfile.mkdtemp(prefix="splitserve-placement-"))
    procs = ProcessSet(log_dir=tmp)
    every = os.sched_getaffinity(0)
    spare = free_cores([cfg.engine_cores])
    engine = every - spare
    if not spare:
        raise SystemExit("needs a core the engine does not use")
    # name: (serving cores, serving nice), (EngineCore cores, EngineCore nice)
    known = {"free": ((every, 0), (every, 0)), "pinned": ((spare, 0), (every, 0)),
             "niced": ((every, 10), (every, 0)),
             "core-niced": ((spare, 0), (every, ENGINE_CORE_NICE)),
             "core-beside": ((spare, 0), (engine, 0))}
    variants = {k: known[k] for k in a.variants.split(",")}
    results: dict[str, list[dict]] = {k: [] for k in variants}
    try:
        url = start_splitserve(cfg, model, procs)
        pids = [p.popen.pid for p in procs.procs]
        schedulers = engine_cores(pids)
        drive("vllm", url, model, a.rate, a.seed, cfg, tmp / "warm.json")  # not counted
        names = list(variants)
        seed = a.seed
        for rnd in range(a.rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                serving, core = variants[name]
                place_threads(pids, *serving)
                place_threads(schedulers, *core)
                # A seed per drive: prompts seen before would be prefix-cache hits.
                seed += 1
                r = drive("vllm", url, model, a.rate, seed, cfg, tmp / f"{name}-{rnd}.json")
                results[name].append(r)
                print(f"round {rnd} {name:7} attainment {r['attainment']:.0%} TTFT p50 "
                      f"{r['median_ttft_ms']:.0f} p99 {r['p99_ttft_ms']:.0f} ms TPOT p50 "
                      f"{r['median_tpot_ms']:.1f} ms", flush=True)
    finally:
        procs.stop(15)
    for name, rs in results.items():
        if rs:
            print(f"{name:7} attainment {statistics.mean(r['attainment'] for r in rs):.0%}  "
                  f"TTFT p50 {statistics.median(r['median_ttft_ms'] for r in rs):.0f} ms  "
                  f"TPOT p50 {statistics.median(r['median_tpot_ms'] for r in rs):.1f} ms")


if __name__ == "__main__":
    main()
