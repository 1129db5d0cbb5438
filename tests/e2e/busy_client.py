"""A streaming client run as a program of its own, in a session of its own, as a user's load
tool is: with `--hog` it shares that session with a process using about a third of a core.

    python -m tests.e2e.busy_client URL MODEL MAX_TOKENS [--hog] [--stream-interval N] < PROMPTS

Streams each prompt (a list of token ids) alone, one after another, and prints one JSON object:
the first-token times and the gaps between later events (after the second token's: the first
gap is the KV hand-off), in seconds. The hog ends with this program, or by itself after HOG_S.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import httpx

# Busy 10 ms, asleep 20 ms: a third of a core.
HOG = ("import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n"
       "    t = time.perf_counter()\n    while time.perf_counter() - t < 0.01: pass\n"
       "    time.sleep(0.02)\n")
HOG_S = 120


def stream_all(url: str, model: str, max_tokens: int, prompts: list[list[int]],
               stream_interval: int = 1) -> dict:
    firsts, gaps = [], []
    with httpx.Client(timeout=120) as client:
        for ids in prompts:
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0, "stream": True, "stream_interval": stream_interval}
            t0 = time.perf_counter()
            times = []
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
            firsts.append(times[0] - t0)
            gaps += [b - a for a, b in zip(times[1:], times[2:])]
    return {"firsts": firsts, "gaps": gaps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("max_tokens", type=int)
    ap.add_argument("--hog", action="store_true")
    ap.add_argument("--stream-interval", type=int, default=1)
    a = ap.parse_args()
    prompts = json.load(sys.stdin)
    hog = (subprocess.Popen([sys.executable, "-c", HOG.format(s=HOG_S)]) if a.hog else None)
    try:
        out = stream_all(a.url, a.model, a.max_tokens, prompts, a.stream_interval)
        out["hog_ran"] = hog is not None and hog.poll() is None
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
