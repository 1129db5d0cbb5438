"""`splitserve bench`: an SLO-driven load test against a running router.

Lifecycle: build the workload (synthetic lengths, a long/short mixture, shared-prefix groups, or a
ShareGPT file) → warm up with one request → for each rate of the sweep, release the requests on
a seeded arrival process (or closed-loop at a fixed concurrency) and record every chunk →
summarise each run with vLLM's benchmark field names plus SLO attainment and goodput → the
goodput is the highest swept rate with >= `--target` attainment, also per worker → JSON + PNGs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI builds its parser from add_arguments: keep that import light
    from bench.workload import RequestSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--router", default="127.0.0.1:50051", help="router gRPC address")
    t.add_argument("--http-url", default=None, help="use the OpenAI HTTP API at this base URL")
    t.add_argument("--model", default=None,
                   help="the served model, for its tokenizer: smollm2 (default), tiny, or a dir")
    t.add_argument("--model-name", default="", help="served model name (default: the router's)")
    t.add_argument("--num-workers", type=int, default=None,
                   help="workers serving (for goodput per worker; default: ask the router)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=100)
    w.add_argument("--input-len", default="uniform:64-512", help="fixed:N | uniform:A-B | "
                   "lognormal:MEDIAN,SIGMA[@MIN-MAX]")
    w.add_argument("--output-len", default="uniform:32-128")
    w.add_argument("--long-fraction", type=float, default=0.0,
                   help="share of requests drawn from --long-input-len/--long-output-len")
    w.add_argument("--long-input-len", default="uniform:1024-2048")
    w.add_argument("--long-output-len", default="fixed:16")
    w.add_argument("--shared-prefix-len", type=int, default=0)
    w.add_argument("--num-groups", type=int, default=0)
    w.add_argument("--sharegpt", default=None, help="ShareGPT-format JSON file")
    w.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("arrivals")
    a.add_argument("--rate", default="inf", help="req/s; a comma list sweeps (e.g. 1,2,4,8)")
    a.add_argument("--arrival", default="poisson", choices=["poisson", "gamma", "constant"])
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    a.add_argument("--concurrency", type=int, default=None, help="closed loop: max in flight")
    o = p.add_argument_group("SLOs and output")
    o.add_argument("--slo", default=None,
                   help="targets, each with its unit (ms or s): e.g. ttft=500ms,tpot=50ms,e2el=5s")
    o.add_argument("--target", type=float, default=0.9, help="attainment that defines goodput")
    o.add_argument("--result-json", default=None)
    o.add_argument("--plot-dir", default=None)
    o.add_argument("--label", default="run", help="name of this deployment in plots and JSON")
    o.add_argument("--no-progress", action="store_true")


def build_workload(a: argparse.Namespace, tokenizer) -> list[RequestSpec]:
    from bench.workload import LengthDist, mixture, sharegpt, synthetic

    if a.sharegpt:
        return sharegpt(a.sharegpt, a.num_prompts, tokenizer.encode, a.seed)
    exclude = tuple(tokenizer.special_ids)
    n_long = round(a.num_prompts * a.long_fraction)
    short = synthetic(a.num_prompts - n_long, LengthDist.parse(a.input_len),
                      LengthDist.parse(a.output_len), tokenizer.vocab_size, a.seed,
                      exclude_ids=exclude, shared_prefix_len=a.shared_prefix_len,
                      num_groups=a.num_groups)
    if not n_long:
        return short
    long = synthetic(n_long, LengthDist.parse(a.long_input_len),
                     LengthDist.parse(a.long_output_len), tokenizer.vocab_size, a.seed + 1,
                     exclude_ids=exclude)
    return mixture([(1 - a.long_fraction, short), (a.long_fraction, long)], a.seed)


def _rates(s: str) -> list[float]:
    try:
        rates = [float(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--rate: {e}") from e
    if not rates or any(r <= 0 for r in rates):
        raise ValueError("--rate: positive numbers (or inf) expected")
    return rates


async def _workers(a: argparse.Namespace) -> tuple[int, int]:
    """(prefill, decode-or-colocated) workers serving, as the router sees them."""
    import grpc

    from splitserve.v1 import generation_pb2, generation_pb2_grpc

    try:
        async with grpc.aio.insecure_channel(a.router) as ch:
            resp = await generation_pb2_grpc.GenerationStub(ch).ListModels(
                generation_pb2.ListModelsRequest(), timeout=10)
        return (sum(m.prefill_workers for m in resp.models),
                sum(m.decode_workers for m in resp.models))
    except grpc.aio.AioRpcError:
        return (0, 0)


def _rows(results) -> list[dict]:
    """Per-request records (for the planner and for re-plotting), seconds. `first_gap_s`: first
    chunk to second, the KV hand-off as the client sees it; `step_s`: the median gap after it;
    `streams_at_first_token`: how many other requests were streaming then (bench/metrics.py)."""
    from bench.metrics import streams_at_first_token

    def gaps(r) -> dict[str, float | None]:
        g = r.itls
        return {"first_gap_s": g[0] if g else None,
                "step_s": statistics.median(g[1:]) if len(g) > 1 else None}

    return [{"ok": r.ok, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
             "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e, **gaps(r),
             "streams_at_first_token": n,
             **{k: r.server.get(k) for k in ("queue_s", "prefill_s", "transfer_s", "decode_s")}}
            for r, n in zip(results, streams_at_first_token(results))]


async def bench(a: argparse.Namespace) -> dict:
    from bench.arrivals import arrival_times
    from bench.client import GrpcTarget, HttpTarget, run_load
    from bench.metrics import max_goodput_rate, summarize
    from bench.workload import RequestSpec
    from router.text import RouterTokenizer
    from splitserve.models import resolve_model
    from splitserve.slo import SLO

    slo = SLO.parse(a.slo) if a.slo else None  # a bad spelling fails before any work
    tokenizer = RouterTokenizer(resolve_model(a.model))
    specs = build_workload(a, tokenizer)
    target = (HttpTarget(a.http_url, a.model_name) if a.http_url
              else GrpcTarget(a.router, a.model_name))
    runs, per_rate = [], {}
    try:
        # Warm up every path a measured request will take (first long prefill, first pull,
        # first decode batch): one-time costs would otherwise land on the first rate.
        longest = max(specs, key=lambda s: s.prompt_len)
        for spec in (longest, specs[0], specs[-1]):
            warm = await target.send(RequestSpec(spec.prompt_ids, spec.prompt_text, 4))
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        for rate in _rates(a.rate):
            arrivals = (None if a.concurrency else
                        arrival_times(len(specs), rate, a.arrival, a.burstiness, a.seed))
            results, duration = await run_load(target, specs, arrivals, a.concurrency,
                                               progress=not a.no_progress)
            summary = {"rate": rate, **summarize(results, duration, slo)}
            runs.append({**summary, "requests": _rows(results)})
            per_rate[f"{a.label} @ {rate:g}/s"] = results
            _print_run(summary, slo)
        n_prefill, n_decode = await _workers(a)
        workers = a.num_workers or (n_prefill + n_decode) or 1
    finally:
        await target.close()
    out = {"label": a.label, "config": _config(a), "slo": asdict(slo) if slo else None,
           "num_workers": workers, "num_prefill_workers": n_prefill,
           "num_decode_workers": n_decode, "concurrency": a.concurrency, "runs": runs}
    if slo is not None:
        points = [(r["rate"], r["slo_attainment"]) for r in runs]
        best = max_goodput_rate(points, a.target)
        out.update(goodput_rate=best, goodput_per_worker=best / workers if best else None)
        print(f"goodput ({a.target:.0%} attainment): "
              f"{best if best is not None else 'none of the swept rates'} req/s"
              + (f" = {best / workers:.3g} req/s per worker ({workers} workers)" if best else ""))
    if len(runs) == 1:  # single run: vLLM's flat layout too
        out.update({k: v for k, v in runs[0].items() if k != "requests"})
    if a.result_json:
        Path(a.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result_json).write_text(json.dumps(out, indent=2) + "\n")
    if a.plot_dir:
        _plot(Path(a.plot_dir), a, runs, per_rate)
    return out


def _plot(d: Path, a: argparse.Namespace, runs: list[dict], per_rate: dict) -> None:
    from bench import plots

    if runs and runs[0].get("slo_attainment") is not None:
        plots.attainment_vs_rate({a.label: [(r["rate"], r["slo_attainment"]) for r in runs]},
                                 a.target, d / "attainment_vs_rate.png")
    plots.latency_cdfs(per_rate, d / "latency_cdf.png")
    plots.breakdown({f"{r['rate']:g}/s": r for r in runs}, d / "breakdown.png")


def _config(a: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(a).items() if k != "func"}


def _print_run(s: dict, slo) -> None:
    line = (f"rate {s['rate']:>6g}/s: {s['completed']} ok, {s['failed']} failed in "
            f"{s['duration']:.1f} s | TTFT p50 {s['median_ttft_ms']:.0f} p99 "
            f"{s['p99_ttft_ms']:.0f} ms | TPOT p50 {s['median_tpot_ms']:.1f} p99 "
            f"{s['p99_tpot_ms']:.1f} ms | {s['output_throughput']:.0f} tok/s")
    if slo is not None:
        line += f" | SLO attainment {s['slo_attainment']:.0%}"
    print(line, file=sys.stderr, flush=True)


def main(a: argparse.Namespace) -> int:
    asyncio.run(bench(a))
    return 0
