"""What the router adds: TTFT and time per output token through the router vs straight to a worker.

One colocated worker (tiny model by default) and a router that knows it statically. The same
greedy requests alternate between the two paths, so machine noise hits both alike:
  direct   DecodeWorker.Decode on the worker (token ids in, token ids out)
  router   Generation.Generate on the router (validation, admission, routing, detokenisation)
Overheads are medians of the paired differences (each router request minus the direct one just
before it): the engine has slow stretches tens of requests long (docs/benchmarks-log.md,
"Router overhead"), which move a
difference of medians by more than the goal, while a pair sits inside one stretch. Then the
router's throughput on one core, fronting a token source instead of an engine
(bench/router_throughput.py). Prints both tables and, with --json FILE, writes the numbers.

    python -m bench.router_overhead [--requests 100] [--max-tokens 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import grpc

from bench.router_throughput import measure
from bench.router_throughput import report as report_throughput
from deploy.placement import pin_serving
from deploy.procs import ProcessSet
from splitserve.engine import spread_cores
from splitserve.models import resolve_model
from splitserve.roles import Role
from splitserve.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)


def timed(call) -> tuple[float, float]:
    """(TTFT, TPOT) of one streaming call, started here (`call()` sends the request: the clock
    starts before it). TPOT = (last - first token) / (tokens - 1): chunk gaps alone would
    mislead, since several tokens can arrive in one chunk."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    for chunk in call():
        if chunk.token_ids:
            last = time.perf_counter()
            first = first or last
            n += len(chunk.token_ids)
    return first - t0, (last - first) / max(n - 1, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = resolve_model(a.model)
    cluster = ProcessSet()
    try:
        engine_core = spread_cores(0)
        w = cluster.spawn("worker", [Role.COLOCATED.value, "--model", model, "--metrics-port", "0",
                                     "--cpu-cores", engine_core], Role.COLOCATED)
        cluster.wait_ready([w], 300)
        r = cluster.spawn("router", ["router", "--model", model, "--grpc-port", "0",
                                     "--http-port", "0", "--static-colocated", w.address])
        cluster.wait_ready([r], 60)
        pin_serving([w.popen.pid, r.popen.pid], [engine_core])  # as `splitserve up` places them
        results = run(w.address, r.address, a.requests, a.max_tokens)
    finally:
        cluster.stop(grace_s=10)
    rows = report(results, a)
    print()
    throughput = measure(a.model, [1, 32], seconds=6.0, tokens_per_request=256, intervals=(1, 2))
    report_throughput(throughput)
    if a.json:
        rows["throughput"] = [t.row() for t in throughput]
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")


def run(worker: str, router: str, n: int, max_tokens: int) -> dict[str, dict[str, list[float]]]:
    sp = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(5, 69))  # 64 tokens
    out = {"direct": {"ttft": [], "tpot": []}, "router": {"ttft": [], "tpot": []}}
    with grpc.insecure_channel(worker) as wch, grpc.insecure_channel(router) as rch:
        direct = worker_pb2_grpc.DecodeWorkerStub(wch)
        via = generation_pb2_grpc.GenerationStub(rch)
        deadline = time.monotonic() + 60  # the router polls its static worker before routing
        while True:
            try:
                via.Complete(generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=prompt), sampling=sp), timeout=30)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        for i in range(2 * n):  # alternate paths; the first pair warms both up
            if i % 2 == 0:
                req = worker_pb2.DecodeRequest(request_id=f"b{i}", prompt_token_ids=prompt,
                                               sampling=sp)
                ttft, tpot = timed(lambda r=req: direct.Decode(r, timeout=60))
                key = "direct"
            else:
                req = generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=prompt), sampling=sp)
                ttft, tpot = timed(lambda r=req: via.Generate(r, timeout=60))
                key = "router"
            if i >= 2:
                out[key]["ttft"].append(ttft)
                out[key]["tpot"].append(tpot)
    return out


def report(r: dict[str, dict[str, list[float]]], a: argparse.Namespace) -> dict:
    med = {k: {m: statistics.median(v[m]) * 1e3 for m in ("ttft", "tpot")} for k, v in r.items()}
    paired = {m: statistics.median(b - a for a, b in zip(r["direct"][m], r["router"][m])) * 1e3
              for m in ("ttft", "tpot")}
    rows = {
        "ttft_ms_direct": med["direct"]["ttft"], "ttft_ms_router": med["router"]["ttft"],
        "ttft_overhead_ms": paired["ttft"],
        "tpot_ms_direct": med["direct"]["tpot"], "tpot_ms_router": med["router"]["tpot"],
        "tpot_overhead_ms": paired["tpot"],
        "ttft_ratio": med["router"]["ttft"] / med["direct"]["ttft"],
        "tpot_ratio": med["router"]["tpot"] / med["direct"]["tpot"],
        "requests_per_path": a.requests - 1, "max_tokens": a.max_tokens,
    }
    print(f"{'':8} {'TTFT ms (median)':>18} {'TPOT ms (median)':>18}")
    for k in ("direct", "router"):
        print(f"{k:8} {med[k]['ttft']:18.2f} {med[k]['tpot']:18.3f}")
    print(f"{'overhead':8} {rows['ttft_overhead_ms']:+18.2f} {rows['tpot_overhead_ms']:+18.3f}"
          f"   (median of paired differences; ratio of medians {rows['ttft_ratio']:.2f}x TTFT, "
          f"{rows['tpot_ratio']:.2f}x TPOT)")
    return rows


if __name__ == "__main__":
    main()
