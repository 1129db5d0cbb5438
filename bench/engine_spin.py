"""What the engines' short spin costs under load: `splitserve up` (1P1D) with `--spin-s` at
each value, in turn, under the same Poisson load.

splitserve/engine_spin.py shortens vLLM's one-second spin of its queue readers to 2 ms so that
other programs on a small host keep their share of the cores. A reader that sleeps must then be
woken by a socket notification, which costs each engine step a little: this measures how much,
on the tiny model by default (its ~4 ms steps make that cost as large a share as it gets).

    python bench/engine_spin.py [--spins 0.002,1] [--rounds 2] [--model tiny] [--rate 6]
                                [--num-prompts 120] [--input-len uniform:256-1024]
                                [--output-len fixed:64]

Prints one row per run (the values alternate, so drift on a shared host falls on both):
TTFT and TPOT p50/p99 (ms), output tokens per second, SLO attainment.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.aiperf import wait_ready
from bench.host import machine
from deploy.procs import child_group
from splitserve.slo import SLO

ROOT = Path(__file__).resolve().parents[1]


def run_once(spin: str, a: argparse.Namespace, work: Path, k: int) -> dict:
    log = work / f"up-{k}.log"
    up = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", "--model", a.model, "--http-port",
         str(a.port), "--grpc-port", "0", "--log-dir", str(work / f"logs-{k}"),
         "--spin-s", spin], cwd=ROOT, stdin=subprocess.DEVNULL,
        stdout=open(log, "w"), stderr=subprocess.STDOUT, **child_group())
    url = f"http://127.0.0.1:{a.port}"
    try:
        wait_ready(url, "/health")
        out = work / f"run-{k}.json"
        subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "--http-url", url,
                        "--model", a.model, "--num-prompts", str(a.num_prompts), "--input-len",
                        a.input_len, "--output-len", a.output_len, "--rate", str(a.rate),
                        "--seed", str(a.seed + k), "--slo", a.slo, "--no-progress",
                        "--result-json", str(out)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        r = json.loads(out.read_text())
        keys = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "output_throughput", "completed")
        return {"spin_s": spin, "attainment": r.get("slo_attainment"),
                **{key: r.get(key) for key in keys}}
    finally:
        up.send_signal(2)
        up.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spins", default="0.002,1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rate", type=float, default=6)
    ap.add_argument("--num-prompts", type=int, default=120)
    ap.add_argument("--input-len", default="uniform:256-1024")
    ap.add_argument("--output-len", default="fixed:64")
    ap.add_argument("--slo", default="ttft=500ms,tpot=50ms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8310)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        SLO.parse(a.slo)  # refused here, before any engine starts
    except ValueError as e:
        ap.error(f"--slo: {e}")
    work = Path(tempfile.mkdtemp(prefix="splitserve-spin-"))
    spins = a.spins.split(",")
    rows = []
    for k, spin in enumerate(s for _ in range(a.rounds) for s in spins):
        rows.append(run_once(spin, a, work, k // len(spins)))  # a round shares its prompts
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n1P1D, {a.model}, {a.num_prompts} prompts {a.input_len} in / {a.output_len} out at "
          f"{a.rate} req/s (Poisson), SLO {a.slo}; {machine()}")
    print(f"{'spin s':>7}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
          f"{'tok/s':>8}{'attain':>8}")
    def f(r: dict, key: str, spec: str) -> str:
        v = r.get(key)
        return format("-", ">" + spec.split(".")[0]) if v is None else format(v, spec)

    for r in rows:
        print(f"{r['spin_s']:>7}{f(r, 'median_ttft_ms', '10.1f')}{f(r, 'p99_ttft_ms', '10.1f')}"
              f"{f(r, 'median_tpot_ms', '10.2f')}{f(r, 'p99_tpot_ms', '10.2f')}"
              f"{f(r, 'output_throughput', '8.0f')}{f(r, 'attainment', '8.2f')}")
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
