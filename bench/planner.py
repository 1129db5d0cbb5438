"""`splitserve plan`: recommend prefill:decode worker counts from measured load-test runs (the
model itself is splitserve/planner.py, which the Ray autoscaler uses too)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from splitserve.planner import Profile, assumptions, cheapest, fit_profile, load_rows, recommend
from splitserve.slo import SLO


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench import kv_memory

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", nargs="+", metavar="RESULT.json",
                     help="bench result JSONs to fit the profile (and take the workload) from")
    src.add_argument("--profile-json", metavar="PROFILE.json", help="a saved profile")
    src.add_argument("--memory", metavar="MODEL", help="instead: KV memory of one worker of "
                     "MODEL (a directory or a preset name): bytes per token, blocks, context, "
                     "concurrent sequences (bench/kv_memory.py)")
    p.add_argument("--rate", type=float, help="offered load, req/s (with --profile*)")
    p.add_argument("--slo", help="e.g. ttft=1s,tpot=100ms[,e2el=5s]: each with its unit, ms or s "
                   "(with --profile*)")
    p.add_argument("--input-len", type=int, help="fixed prompt tokens (default: the runs')")
    p.add_argument("--output-len", type=int, help="fixed output tokens (default: the runs')")
    p.add_argument("--target", type=float, default=0.9, help="SLO attainment to reach")
    p.add_argument("--max-workers", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=2000, help="simulated per config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-profile", metavar="FILE", help="write the fitted profile as JSON")
    kv_memory.add_arguments(p)


def main(a: argparse.Namespace) -> int:
    if a.memory:
        from bench import kv_memory

        return kv_memory.run(a)
    if a.rate is None or a.slo is None:
        print("splitserve plan: --rate and --slo are required with --profile/--profile-json",
              file=sys.stderr)
        return 2
    try:
        rows = [r for r in load_rows(a.profile or []) if r.get("ok", True)]
        profile = (Profile.from_dict(json.loads(Path(a.profile_json).read_text()))
                   if a.profile_json else fit_profile(rows))
        workload = [(a.input_len or r["prompt_tokens"], a.output_len or r["output_tokens"])
                    for r in ([{}] if a.input_len and a.output_len else rows)]
        if not workload:
            raise ValueError("no request rows to take the workload from: give --input-len and "
                             "--output-len")
        slo = SLO.parse(a.slo)
    except (OSError, KeyError, ValueError) as e:
        print(f"splitserve plan: {e}", file=sys.stderr)
        return 2
    if a.save_profile:
        Path(a.save_profile).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    print("profile: " + ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in profile.to_dict().items()))
    print("assumptions:\n" + "\n".join(f"  - {line}" for line in assumptions()))
    rows_out = recommend(profile, a.rate, workload, slo, a.target, a.max_workers, a.seed,
                         a.num_requests)
    print(f"\n{a.rate:g} req/s, SLO {slo}, {len(workload)} request shapes\n"
          f"{'config':<14}{'workers':>8}{'attain':>9}{'p90 TTFT ms':>13}{'p90 TPOT ms':>13}")
    for r in rows_out:
        print(f"{r.label:<14}{r.workers:>8}{r.attainment:>9.1%}{r.ttft_ms.p90:>13.1f}"
              f"{r.tpot_ms.p90:>13.2f}")
    best = cheapest(rows_out, a.target)
    print(f"recommendation: none up to {a.max_workers} workers reaches {a.target:.0%} attainment"
          if best is None else f"recommendation: {best.label} ({best.workers} workers): "
          f"{best.attainment:.1%} attainment, p90 TTFT {best.ttft_ms.p90:.1f} ms, p90 TPOT "
          f"{best.tpot_ms.p90:.2f} ms, {best.goodput_rps / best.workers:.3g} good req/s/worker")
    return 0
