"""The SLO autoscaler under a rate step, against fixed deployments.

Ray deployments of one model run one after the other on a local Ray cluster started here:
  fixed-PpDd  P prefill + D decode workers all along (`--fixed`, default 1P1D and the
              autoscaler's ceiling, 2P2D);
  autoscaled  starts at 1P1D, `--autoscale` within [1, --max-workers] per pool.
Each gets the same open-loop workload: Poisson arrivals whose rate steps through the phases
(default 0.5 req/s for 60 s, 2 for 120 s, 0.5 for 90 s), the same random prompts. Printed per
deployment and phase: SLO attainment (TTFT and TPOT of each request against --slo) and requests;
per deployment: worker-seconds (the deployment's worker count integrated over the run, polled
every second) and the autoscaler's scaling events.

    python bench/autoscale_step.py [--model bench] [--phases 0.5:60,2:120,0.5:90]
        [--slo ttft=3s,tpot=100ms] [--fixed 1:1,2:2] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import tempfile
import threading
import time
from pathlib import Path

from bench.arrivals import arrival_times
from bench.client import GrpcTarget, run_load
from bench.workload import synthetic
from deploy.ray.config import AutoscaleConfig
from splitserve.models import resolve_model
from splitserve.slo import SLO


def schedule(phases: list[tuple[float, float]], seed: int) -> tuple[list[float], list[int]]:
    """Send times over all phases (Poisson within each) and each request's phase index."""
    times, phase_of, t0 = [], [], 0.0
    for k, (rate, length) in enumerate(phases):
        n = max(1, round(rate * length))
        for t in arrival_times(n, rate, seed=seed + k):
            if t < length:
                times.append(t0 + t)
                phase_of.append(k)
        t0 += length
    return times, phase_of


def _ray_init(tmp: Path) -> None:
    """A Ray cluster of our own: files in `tmp`, token auth with a token only we hold, workers
    at normal priority (as `splitserve ray up` starts its local cluster)."""
    import ray
    from ray._raylet import Config

    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                       "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"})
    Config.initialize("")  # re-read the auth mode, as ray.init does when it turns auth on
    ray.init(_temp_dir=str(tmp), num_cpus=8, include_dashboard=False, log_to_driver=False)


def run_one(name: str, size: tuple[int, int], a: argparse.Namespace,
            autoscale: AutoscaleConfig | None, specs, times, phase_of) -> dict:
    from deploy.ray.api import deploy

    d = deploy(a.model, *size, name=name, host="127.0.0.1", grpc_port=0,
               cluster_port=0, http_port=0, autoscale=autoscale,
               engine_args=tuple(a.engine_args.split()))
    sizes: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            s = d.sizes()
            sizes.append((time.monotonic(), s["prefill"], s["decode"]))
            stop.wait(1.0)

    poller = threading.Thread(target=poll, daemon=True)
    try:
        t_start = time.monotonic()
        poller.start()
        results, wall = asyncio.run(_drive(d.address, specs, times))
        stop.set()
        poller.join()
        events = d.status()["events"]
    finally:
        stop.set()
        d.shutdown()
    slo = SLO.parse(a.slo)
    per_phase = []
    for k in range(len(a.phase_list)):
        rs = [r for r, p in zip(results, phase_of) if p == k]
        per_phase.append({"rate": a.phase_list[k][0], "seconds": a.phase_list[k][1],
                          "requests": len(rs), "failed": sum(not r.ok for r in rs),
                          "attainment": sum(slo.meets(r) for r in rs) / max(len(rs), 1)})
    worker_s = sum((t1 - t0) * (p + dd) for (t0, p, dd), (t1, _, _) in zip(sizes, sizes[1:]))
    return {"deployment": name, "wall_s": wall, "worker_seconds": worker_s,
            "attainment": sum(slo.meets(r) for r in results) / max(len(results), 1),
            "phases": per_phase, "events": events,
            "max_workers": max((p + dd for _, p, dd in sizes), default=sum(size)),
            "timeline": [(t - t_start, p, dd) for t, p, dd in sizes]}


def _phase(p: dict) -> str:
    failed = f" ({p['failed']} failed)" if p["failed"] else ""
    return f"{p['rate']:g} req/s: {p['attainment']:.0%} of {p['requests']}{failed}"


async def _drive(address: str, specs, times):
    target = GrpcTarget(address, timeout_s=600)  # inside the loop: a grpc.aio channel binds to it
    try:
        return await run_load(target, specs, times, progress=False)
    finally:
        await target.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench", help="model dir or preset (default: bench)")
    ap.add_argument("--phases", default="0.5:60,2:120,0.5:90", help="RATE:SECONDS,...")
    ap.add_argument("--input-len", default="uniform:256-1024")
    ap.add_argument("--output-len", default="uniform:32-96")
    ap.add_argument("--slo", default="ttft=3s,tpot=100ms",
                    help="each with its unit, ms or s; the autoscaler's too (p90)")
    ap.add_argument("--max-workers", type=int, default=2, help="per pool, autoscaled")
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--cooldown-s", type=float, default=30.0)
    ap.add_argument("--engine-args", default="--kv-cache-mib 512", help="passed to workers")
    ap.add_argument("--fixed", default="1:1,2:2", help="fixed deployments to compare, P:D,...")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG: workers over time per deployment")
    a = ap.parse_args()
    a.phase_list = [(float(r), float(s)) for r, s in
                    (p.split(":") for p in a.phases.split(","))]
    a.model = resolve_model(a.model)
    slo = SLO.parse(a.slo)
    times, phase_of = schedule(a.phase_list, a.seed)
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    specs = synthetic(len(times), a.input_len, a.output_len, vocab, a.seed,
                      exclude_ids=range(3))
    auto = AutoscaleConfig(max_prefill=a.max_workers, max_decode=a.max_workers,
                           ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s,
                           interval_s=a.interval_s, window_s=a.window_s,
                           cooldown_s=a.cooldown_s)
    import ray

    _ray_init(Path(tempfile.mkdtemp(prefix="splitserve-autoscale-")))
    try:
        fixed = [tuple(int(x) for x in f.split(":")) for f in a.fixed.split(",") if f]
        rows = [run_one(f"fixed-{pp}P{dd}D", (pp, dd), a, None, specs, times, phase_of)
                for pp, dd in fixed]
        rows.append(run_one("autoscaled", (1, 1), a, auto, specs, times, phase_of))
    finally:
        ray.shutdown()
    print(f"model {a.model}; phases {a.phases} (req/s:s); SLO {slo}; {len(specs)} requests")
    for r in rows:
        phases = "  ".join(_phase(p) for p in r["phases"])
        print(f"{r['deployment']:12} attainment {r['attainment']:.0%}  worker-seconds "
              f"{r['worker_seconds']:.0f}  peak workers {r['max_workers']}  |  {phases}")
        for e in r["events"]:
            print(f"{'':12} scaled to {e['prefill']}P{e['decode']}D ({e['reason']})")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": {k: v for k, v in vars(a).items()
                                                     if k != "phase_list"}, "rows": rows},
                                           indent=2) + "\n")
    if a.plot:
        print(f"plot: {plot(rows, a.phase_list, Path(a.plot))}")


def plot(rows: list[dict], phases: list[tuple[float, float]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True,
                                      gridspec_kw={"height_ratios": [1, 2]})
    t, xs, ys = 0.0, [], []
    for rate, length in phases:
        xs += [t, t + length]
        ys += [rate, rate]
        t += length
    top.plot(xs, ys, color="black")
    top.set_ylabel("offered req/s")
    for r in rows:
        ts = [x[0] for x in r["timeline"]]
        label = f"{r['deployment']}: {r['attainment']:.0%} in SLO, {r['worker_seconds']:.0f} w-s"
        bottom.step(ts, [x[1] + x[2] for x in r["timeline"]], where="post", label=label)
    bottom.set_xlabel("seconds since the first request")
    bottom.set_ylabel("workers (P + D)")
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
