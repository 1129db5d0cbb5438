"""How long `splitserve up` takes to be ready: compiled from a cold cache, compiled from a warm
one, and eager, side by side in one run.

Each round starts `up --demo` (router + 1 prefill + 1 decode by default) and times it from the
command to its "ready" line; the demo's answer checks that the cluster serves. "cold" uses a new,
empty compile cache (`--compile-cache-dir`), "warm" the cache the cold round filled, "eager"
`--enforce-eager`. Rounds run in the order given, so a noisy moment shows as a spread between
repeats of one variant, not as a difference between variants.

    python -m bench.startup [--model smollm2] [--order cold,warm,eager,warm,eager] [-- UP_FLAGS]

Prints each round's seconds to ready, then per variant the median and its ratio to eager's.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.host import machine

ROOT = Path(__file__).resolve().parents[1]


def start_once(model: str, variant: str, cache: Path | None, extra: list[str]) -> float:
    """Seconds from `up` to its ready line; the cluster answers the demo and stops."""
    flags = ["--enforce-eager"] if variant == "eager" else ["--compile-cache-dir", str(cache)]
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--model", model, "--grpc-port", "0",
           "--http-port", "0", "--demo", "What is the capital of France?", *flags, *extra]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    ready = None
    lines = []
    for line in p.stderr:
        lines.append(line)
        if ready is None and re.match(r"\[splitserve\] ready in", line):
            ready = time.monotonic() - t0
    answer = p.stdout.read()
    if p.wait() != 0 or ready is None or not answer.strip():
        raise RuntimeError(f"{variant}: up failed:\n{''.join(lines[-20:])}")
    return ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--order", default="cold,warm,eager,warm,eager")
    ap.add_argument("--json", default=None)
    ap.add_argument("up_flags", nargs="*", help="after --: more flags for `up`")
    a = ap.parse_args()
    cache = None
    caches = []  # removed at the end: each holds a compiled model
    took: dict[str, list[float]] = {}
    try:
        for variant in a.order.split(","):
            if variant not in ("cold", "warm", "eager"):
                raise SystemExit(f"unknown variant {variant!r}")
            if variant == "cold":
                cache = Path(tempfile.mkdtemp(prefix="splitserve-compile-cache-"))
                caches.append(cache)
            elif variant == "warm" and cache is None:
                raise SystemExit("a warm start needs a cold one before it (--order)")
            s = start_once(a.model, variant, cache, a.up_flags)
            took.setdefault(variant, []).append(s)
            print(f"{variant:<6} {s:6.1f} s to ready", flush=True)
    finally:
        for c in caches:
            shutil.rmtree(c, ignore_errors=True)
    eager = statistics.median(took["eager"]) if "eager" in took else None
    print(f"\n`up --model {a.model}` to ready; {machine()}")
    for variant, xs in took.items():
        ratio = f"  {statistics.median(xs) / eager:.2f}x eager" if eager else ""
        runs = ", ".join(f"{x:.1f}" for x in xs)
        print(f"{variant:<6} median {statistics.median(xs):6.1f} s  ({runs}){ratio}")
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine(), "model": a.model,
                                            "seconds": took}, indent=1))


if __name__ == "__main__":
    main()
