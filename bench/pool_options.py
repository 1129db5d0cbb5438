"""One deployment with and without a worker or router option, on one workload, side by side.

    python bench/pool_options.py --model tiny --prefill 1 --decode 1 \\
        --variant "base::" --variant "fp8::--kv-cache-dtype fp8" \\
        -- --num-prompts 40 --rate 2 --slo ttft=1s,tpot=25ms

Each `--variant NAME::WORKER_ARGS[::ROUTER_ARGS]` starts the same deployment (a router and the
pools, each engine on its own core where cores allow, as bench/compare.py does) with those extra
flags, runs `splitserve bench` with the flags after `--`, reads every worker's Stats before and
after the load, and stops it. Variants run one after the other, in the order given, on the same
prompts. Printed per variant and rate: SLO attainment, TTFT and TPOT percentiles, output
tokens/s; per variant, from the workers: the prefill pool's prefix-cache hit rate, KV pulled per
request, the decode pool's speculative acceptance rate, and the KV blocks per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import grpc

from bench.compare import start
from bench.host import machine
from bench.run import add_arguments, bench
from deploy.procs import ProcessSet
from router.registry import worker_stub
from splitserve.models import resolve_model
from splitserve.roles import Role
from splitserve.v1 import worker_pb2

_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "kv_pulls", "kv_pulled_bytes",
             "spec_draft_tokens", "spec_accepted_tokens")


def parse_variant(text: str) -> tuple[str, list[str], list[str]]:
    name, _, rest = text.partition("::")
    worker, _, router = rest.partition("::")
    if not name:
        raise ValueError(f"--variant {text!r}: NAME::WORKER_ARGS[::ROUTER_ARGS]")
    return name, worker.split(), router.split()


def pool_counters(cluster: ProcessSet) -> dict[str, dict[str, int]]:
    """Each pool's counters summed over its workers, and its KV blocks per worker."""
    out: dict[str, dict[str, int]] = {}
    for p in cluster.procs:
        if p.role is None:
            continue
        with grpc.insecure_channel(p.address) as ch:
            s = worker_stub(p.role, ch).Stats(worker_pb2.StatsRequest(), timeout=30)
        pool = out.setdefault(p.role.value, dict.fromkeys(_COUNTERS, 0))
        for k in _COUNTERS:
            pool[k] += getattr(s, k)
        pool["kv_blocks"] = s.load.total_kv_blocks
    return out


def _delta(after: dict, before: dict) -> dict:
    return {pool: {k: v - before[pool].get(k, 0) if k != "kv_blocks" else v
                   for k, v in c.items()} for pool, c in after.items()}


def run_variant(model: str, roles: list[Role], name: str, worker_args: list[str],
                router_args: list[str], engine_args: list[str], passthrough: list[str],
                out: Path) -> dict:
    cluster = ProcessSet()
    try:
        router = start(model, roles, [*engine_args, *worker_args], cluster, router_args)
        bp = argparse.ArgumentParser()
        add_arguments(bp)
        args = bp.parse_args([*passthrough, "--router", router, "--model", model, "--label",
                              name, "--result-json", str(out / f"{name}.json"),
                              "--no-progress"])
        print(f"== {name}: workers {' '.join(worker_args) or '-'}; router "
              f"{' '.join(router_args) or '-'}", file=sys.stderr, flush=True)
        before = pool_counters(cluster)
        res = asyncio.run(bench(args))
        workers = _delta(pool_counters(cluster), before)
    finally:
        cluster.stop(grace_s=15)
    return {"variant": name, "worker_args": worker_args, "router_args": router_args,
            "runs": [{**{k: v for k, v in r.items() if k != "requests"},
                      **handoff(r["requests"])} for r in res["runs"]],
            "workers": workers}


def handoff(requests: list[dict]) -> dict[str, float | int | None]:
    """Medians (ms) over the run's requests of the first-to-second token gap (the KV hand-off
    as the client sees it), of the decode step after it, and of the KV transfer the router
    timed: the hand-off goal is gap <= step + transfer + 10 ms. The gap again, split by whether
    other requests were streaming at the first token: an idle decode engine can run the
    request's step as soon as the KV lands; a busy one first ends the step it is in."""
    def p50(key: str, rows: list[dict] = requests) -> float | None:
        xs = [r[key] for r in rows if r.get("ok") and r.get(key) is not None]
        return 1e3 * statistics.median(xs) if xs else None

    idle = [r for r in requests if r.get("streams_at_first_token") == 0]
    busy = [r for r in requests if (r.get("streams_at_first_token") or 0) > 0]
    return {"median_first_gap_ms": p50("first_gap_s"), "median_step_ms": p50("step_s"),
            "median_transfer_ms": p50("transfer_s"),
            "median_first_gap_idle_ms": p50("first_gap_s", idle), "idle_requests": len(idle),
            "median_first_gap_busy_ms": p50("first_gap_s", busy), "busy_requests": len(busy)}


def _pools_line(v: dict) -> str:
    w, parts = v["workers"], []
    pre = w.get("prefill") or w.get("colocated")
    if pre and pre["prefix_cache_queries"]:
        parts.append(f"prefix hits {pre['prefix_cache_hits'] / pre['prefix_cache_queries']:.0%}")
    dec = w.get("decode") or w.get("colocated")
    if dec:
        if dec["kv_pulls"]:
            parts.append(f"KV pulled {dec['kv_pulled_bytes'] / dec['kv_pulls'] / 1024:.0f} KiB"
                         f"/transfer")
        if dec["spec_draft_tokens"]:
            parts.append(f"spec accepted {dec['spec_accepted_tokens']}/"
                         f"{dec['spec_draft_tokens']} "
                         f"({dec['spec_accepted_tokens'] / dec['spec_draft_tokens']:.0%})")
        parts.append(f"KV blocks/worker {dec['kv_blocks']}")
    return ", ".join(parts)


def table(variants: list[dict]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    lines = ["| variant | rate | attainment | TTFT p50 / p99 ms | TPOT p50 / p99 ms | out tok/s "
             "| 1st→2nd token / step / transfer p50 ms | 1st→2nd p50 ms, decode idle / busy |",
             "|---|---|---|---|---|---|---|---|"]
    for v in variants:
        for r in v["runs"]:
            att = r.get("slo_attainment")
            lines.append(f"| {v['variant']} | {r['rate']:g} | "
                         f"{'' if att is None else f'{att:.0%}'} | "
                         f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                         f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | "
                         f"{r['output_throughput']:.0f} | {ms(r.get('median_first_gap_ms'))} / "
                         f"{ms(r.get('median_step_ms'))} / {ms(r.get('median_transfer_ms'))} | "
                         f"{ms(r.get('median_first_gap_idle_ms'))} ({r.get('idle_requests', 0)}) / "
                         f"{ms(r.get('median_first_gap_busy_ms'))} ({r.get('busy_requests', 0)}) |")
    lines.append("")
    lines += [f"- {v['variant']}: {_pools_line(v)}" for v in variants]
    return "\n".join(lines) + "\n"


def main() -> int:
    argv = sys.argv[1:]
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--colocated", type=int, default=0)
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME::WORKER_ARGS[::ROUTER_ARGS] (repeatable)")
    ap.add_argument("--engine-args", default="--kv-cache-mib 256",
                    help="flags for every worker of every variant")
    ap.add_argument("--out", default="results/pool_options")
    a = ap.parse_args(own)
    try:
        variants = [parse_variant(v) for v in a.variant]
    except ValueError as e:
        ap.error(str(e))
    model = resolve_model(a.model)
    roles = ([Role.PREFILL] * a.prefill + [Role.DECODE] * a.decode
             + [Role.COLOCATED] * a.colocated)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_variant(model, roles, name, w, r, a.engine_args.split(), passthrough, out)
            for name, w, r in variants]
    text = table(rows)
    print(f"{machine()['cpu']}; model {a.model}; {a.prefill}P {a.decode}D {a.colocated}C; "
          f"bench {' '.join(passthrough)}")
    print(text)
    (out / "table.md").write_text(text)
    (out / "variants.json").write_text(json.dumps({"machine": machine(), "args": vars(a),
                                                   "variants": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
