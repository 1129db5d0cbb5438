"""Disaggregated vs colocated on the same machine, the same router code, the same workload.

Starts (a) router + 1 prefill + 1 decode worker, runs the load test sweep, stops it; then (b)
router + 2 colocated workers, same sweep. Each engine gets its own core (round robin when
there are more engines than cores). Writes both result
JSONs, combined plots (attainment vs rate, latency CDFs, server-side breakdown) and a markdown
table to --out. Every `splitserve bench` flag after `--` is passed through, e.g.

    python bench/compare.py --model bench --out results/compare -- \\
        --num-prompts 40 --rate 0.25,0.5,1 --long-fraction 0.2 --slo ttft=3s,tpot=100ms
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from bench import plots
from bench.run import add_arguments, bench
from deploy.procs import ProcessSet
from splitserve.models import resolve_model
from splitserve.roles import Role

DEPLOYMENTS = {"1P+1D (disaggregated)": [Role.PREFILL, Role.DECODE],
               "2 colocated": [Role.COLOCATED, Role.COLOCATED]}


def start(model: str, roles: list[Role], engine_args: list[str], cluster: ProcessSet,
          router_args: list[str] = ()) -> str:
    router = cluster.spawn("router", ["router", "--model", model, "--grpc-port", "0",
                                      "--http-port", "0", *router_args])
    cluster.wait_ready([router], 60)
    for i, role in enumerate(roles):
        cluster.spawn(f"{role}{i}", [role.value, "--model", model, "--router", router.address,
                                     "--cpu-cores", str(i % (os.cpu_count() or 1)),
                                     *engine_args], role)
    cluster.wait_ready(timeout_s=600)
    return router.address


def main() -> int:
    argv = sys.argv[1:]
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--out", default="results/compare")
    ap.add_argument("--engine-args", default="--max-model-len 4096 --kv-cache-mib 1024",
                    help="extra flags for every worker")
    a = ap.parse_args(own)
    model = resolve_model(a.model)
    out = Path(a.out)
    results, series, cdfs, bars = {}, {}, {}, {}
    for label, roles in DEPLOYMENTS.items():
        cluster = ProcessSet()
        try:
            router = start(model, roles, a.engine_args.split(), cluster)
            bp = argparse.ArgumentParser()
            add_arguments(bp)
            slug = "pd" if "disagg" in label else "colocated"
            args = bp.parse_args([*passthrough, "--router", router, "--model", model,
                                  "--label", label, "--result-json", str(out / f"{slug}.json"),
                                  "--no-progress"])
            print(f"== {label}", file=sys.stderr, flush=True)
            res = asyncio.run(bench(args))
        finally:
            cluster.stop(grace_s=15)
        results[label] = res
        if res.get("slo"):
            series[label] = [(r["rate"], r["slo_attainment"]) for r in res["runs"]]
        for r in res["runs"]:
            bars[f"{slug} {r['rate']:g}/s"] = r
        cdfs.update(_cdf_inputs(label, res))
    if series:
        plots.attainment_vs_rate(series, args.target, out / "attainment_vs_rate.png")
    plots.breakdown(bars, out / "breakdown.png")
    plots.latency_cdfs(cdfs, out / "latency_cdf.png")
    (out / "table.md").write_text(table(results))
    print(table(results))
    return 0


def _cdf_inputs(label: str, res: dict) -> dict:
    """Rebuild minimal RequestResults from the stored rows, for the CDF plot of the top rate."""
    from bench.metrics import RequestResult

    top = res["runs"][-1]
    rows = []
    for q in top["requests"]:
        if not q["ok"] or q["ttft_s"] is None:
            continue
        n = q["output_tokens"]
        ttft, e2e = q["ttft_s"], q["e2e_s"]
        rows.append(RequestResult(ok=True, start=0.0, chunk_times=[ttft], chunk_tokens=[1],
                                  end=e2e, prompt_tokens=q["prompt_tokens"], output_tokens=n,
                                  server={}))
    return {f"{label} @ {top['rate']:g}/s": rows}


def table(results: dict) -> str:
    lines = ["| deployment | rate (req/s) | SLO attainment | TTFT p50 / p99 (ms) | "
             "TPOT p50 / p99 (ms) | output tok/s | failed |", "|---|---|---|---|---|---|---|"]
    for label, res in results.items():
        for r in res["runs"]:
            att = r.get("slo_attainment")
            lines.append(
                f"| {label} | {r['rate']:g} | {'' if att is None else f'{att:.0%}'} | "
                f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | "
                f"{r['output_throughput']:.1f} | {r['failed']} |")
    for label, res in results.items():
        if res.get("slo"):
            lines.append(f"\n{label}: goodput {res.get('goodput_rate')} req/s "
                         f"({res.get('goodput_per_worker')} per worker)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
