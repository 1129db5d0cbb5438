"""Goodput per engine: plain vLLM, 2 colocated, 1P+1D and conditional 1P+1D on one workload.

The question disaggregation has to answer: on the same host, does it serve more requests within
the SLOs per engine than the alternatives? Deployments, one at a time (started, swept, stopped):
  vllm         vLLM's own OpenAI server, one engine on core 0 (bench/vs_vllm.py starts it)
  colocated2   router + 2 colocated workers, an engine per core
  1p1d         router + 1 prefill + 1 decode worker, an engine per core
  conditional  the same 1p1d with `--conditional-disaggregation` (router/split.py)
  conditional-tpot  conditional, told the TPOT SLO it is scored against (`--tpot-slo`): no
               local prefill that would push a decoding stream past it
A name with `:sessions` after it (`1p1d:sessions`) runs that deployment with each process in a
session of its own, the old way (deploy/procs.py says why they now share ours): the A/B of
that change. Every deployment gets the same fresh random prompts per (rate, driver): one
seed each, so no prefix-cache help and one workload for all. Drivers: vLLM's `vllm bench
serve` and `splitserve bench`, both against the OpenAI HTTP front. `--long-fraction 0.2` mixes
long-document requests (`--long-input-len`, `--long-output-len`) into the short ones: the mixed
workload, which only `splitserve bench` can draw.

    python bench/goodput.py [--rates 2,3,4,6] [--num-prompts 40] [--deployments ...]
                            [--drivers vllm,splitserve] [--stream-interval 1] [--json FILE]

Prints, per driver and rate, each deployment's SLO attainment, TTFT/TPOT medians; then each
deployment's goodput: the highest swept rate with >= --target attainment, and that per engine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.host import machine
from bench.vs_vllm import (
    check_workload,
    drive,
    start_vllm,
    stop_vllm,
    wait_http,
    workload_arguments,
)
from deploy.procs import ProcessSet
from splitserve import scrape
from splitserve.models import resolve_model
from splitserve.roles import Role
from splitserve.slo import SLO

# name: (engines' roles, router flags); "vllm" is plain vLLM, one engine.
DEPLOYMENTS = {
    "vllm": ([], []),
    "colocated2": ([Role.COLOCATED, Role.COLOCATED], []),
    "1p1d": ([Role.PREFILL, Role.DECODE], []),
    "conditional": ([Role.PREFILL, Role.DECODE], ["--conditional-disaggregation"]),
    "conditional-tpot": ([Role.PREFILL, Role.DECODE],
                         ["--conditional-disaggregation", "--tpot-slo", "{tpot_slo_s}"]),
}


def start(name: str, a: argparse.Namespace, model: str, procs: ProcessSet,
          log_dir: Path) -> tuple[str, subprocess.Popen | None]:
    """The deployment's OpenAI base URL (and vLLM's process, for plain vLLM)."""
    if name == "vllm":
        p = start_vllm(a, model, log_dir / "vllm.log", own_session=procs.own_sessions)
        url = f"http://127.0.0.1:{a.vllm_port}"
        wait_http(url)
        return url, p
    roles, flags = DEPLOYMENTS[name]
    router_flags = [f.format(tpot_slo_s=a.slo_tpot_s) for f in flags]
    router = procs.spawn("router", ["router", "--model", model, "--grpc-port", "0",
                                    "--http-port", str(a.splitserve_port),
                                    "--max-model-len", str(a.max_model_len),
                                    "--stream-interval", str(a.stream_interval), *router_flags])
    procs.wait_ready([router], 120)
    for i, role in enumerate(roles):
        procs.spawn(f"{role}{i}", [
            role.value, "--model", model, "--router", router.address, "--dtype", a.dtype,
            "--max-model-len", str(a.max_model_len), "--kv-cache-mib", str(a.kv_cache_mib),
            "--cpu-cores", str(i % a.cores)], role)
    procs.wait_ready(timeout_s=900)
    return router.endpoints["http"], None


def stop(procs: ProcessSet, vllm: subprocess.Popen | None) -> None:
    procs.stop(15)
    if vllm is not None:
        stop_vllm(vllm)


def parse(dep: str) -> tuple[str, bool]:
    """A --deployments entry: the deployment's name, and whether each process gets a session
    of its own (the `:sessions` suffix)."""
    name, _, suffix = dep.partition(":")
    if name not in DEPLOYMENTS or suffix not in ("", "sessions"):
        raise SystemExit(f"unknown deployment {dep!r}: one of {', '.join(DEPLOYMENTS)}, "
                         "optionally with :sessions")
    return name, suffix == "sessions"


def engines(dep: str) -> int:
    return len(DEPLOYMENTS[parse(dep)[0]][0]) or 1


def prefills(url: str) -> dict[str, float]:
    """The router's prefills so far by where they ran ("local", "remote"): its /metrics."""
    return scrape.by_label(scrape.fetch(url + "/metrics"), "splitserve:routing_decisions_total",
                           "prefill")


def attainment(requests: list[dict], slo: SLO) -> float:
    """The share of a drive's requests (its per-request rows, bench/run.py) that meet `slo`."""
    met = sum(slo.meets_times(q["ok"], q["ttft_s"], q["tpot_s"], q["e2e_s"]) for q in requests)
    return met / len(requests) if requests else 0.0


def _split(row: dict) -> str:
    if "local_prefills" not in row:
        return ""
    return f" prefills local/remote {row['local_prefills']:.0f}/{row['remote_prefills']:.0f}"


def goodput(rows: list[dict], dep: str, driver: str, target: float,
            key: str = "attainment") -> float:
    ok = [r["rate"] for r in rows if (r["deployment"], r["driver"]) == (dep, driver)
          and r.get(key, 0.0) >= target]
    return max(ok, default=0.0)


def summarize(rows: list[dict], deps: list[str], drivers: list[str], target: float,
              key: str = "attainment") -> str:
    """The table and the goodputs, by `key`: the attainment at the drives' own SLO, or
    "attainment_also" (--also-slo)."""
    lines = [f"{'driver':10} {'rate':>5} {'deployment':16} {'attain':>7} {'TTFT p50':>9} "
             f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}"]
    for driver in drivers:
        for rate in sorted({r["rate"] for r in rows}):
            for dep in deps:
                for r in rows:
                    if (r["deployment"], r["driver"], r["rate"]) == (dep, driver, rate):
                        lines.append(f"{driver:10} {rate:5g} {dep:16} {r[key]:7.0%} "
                                     f"{r['median_ttft_ms']:9.0f} {r['p99_ttft_ms']:9.0f} "
                                     f"{r['median_tpot_ms']:9.1f} {r['p99_tpot_ms']:9.1f}"
                                     f"{_split(r)}")
    lines.append(f"\ngoodput at {target:.0%} attainment (req/s), and per engine; "
                 "ratio = per engine / plain vLLM's per engine (in the same session layout)")
    for driver in drivers:
        for dep in deps:
            plain = "vllm:sessions" if parse(dep)[1] else "vllm"
            base = goodput(rows, plain, driver, target, key) if plain in deps else 0.0
            g = goodput(rows, dep, driver, target, key)
            per = g / engines(dep)
            ratio = f"{per / base:.2f}x" if base else "n/a"
            lines.append(f"{driver:10} {dep:16} goodput {g:5g}  per engine {per:5.2f}  {ratio}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="default: the generated tiny model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    ap.add_argument("--rates", default="2,3,4,6")
    workload_arguments(ap)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--also-slo", default=None, metavar="ttft=500ms,tpot=50ms",
                    help="score the `splitserve bench` drives against this SLO too, from their "
                         "per-request times (e.g. the seed's ttft=3s,tpot=100ms)")
    ap.add_argument("--cores", type=int, default=2, help="cores the engines spread over")
    ap.add_argument("--seed", type=int, default=2000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    check_workload(ap, a)
    a.engine_cores = "0"  # plain vLLM's one engine (start_vllm reads it)
    model = resolve_model(a.model)
    deps, drivers = a.deployments.split(","), a.drivers.split(",")
    parsed = [parse(dep) for dep in deps]  # fails before anything starts
    also = SLO.parse(a.also_slo) if a.also_slo else None
    rates = [float(r) for r in a.rates.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="splitserve-goodput-"))
    rows: list[dict] = []
    for dep, (name, own_sessions) in zip(deps, parsed):
        (tmp / dep).mkdir()
        procs = ProcessSet(log_dir=tmp / dep, own_sessions=own_sessions)
        url, vllm = None, None
        try:
            url, vllm = start(name, a, model, procs, tmp)
            for i, (driver, rate) in enumerate((d, r) for d in drivers for r in rates):
                seed = a.seed + i  # the same prompts for every deployment
                before = prefills(url) if vllm is None else {}
                r = drive(driver, url, model, rate, seed, a, tmp / f"{dep}-{driver}-{rate}.json")
                if vllm is None:  # where this drive's prefills ran
                    after = prefills(url)
                    r["local_prefills"] = after.get("local", 0) - before.get("local", 0)
                    r["remote_prefills"] = after.get("remote", 0) - before.get("remote", 0)
                requests = r.pop("requests", None)  # `splitserve bench` drives only
                if also is not None and requests is not None:
                    r["attainment_also"] = attainment(requests, also)
                rows.append({"deployment": dep, "driver": driver, "rate": rate, "seed": seed,
                             **r})
                print(f"{dep:16} {driver:10} rate {rate:g} attainment {r['attainment']:.0%} "
                      f"TTFT p50 {r['median_ttft_ms']:.0f} ms TPOT p50 "
                      f"{r['median_tpot_ms']:.1f} ms{_split(r)}", file=sys.stderr, flush=True)
        finally:
            stop(procs, vllm)
    print(summarize(rows, deps, drivers, a.target))
    if also is not None:
        print(f"\nat the SLO {also}, `splitserve bench` drives only:")
        print(summarize(rows, deps, ["splitserve"], a.target, key="attainment_also"))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"machine": machine(), "args": vars(a),
                                            "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
