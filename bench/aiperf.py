"""NVIDIA's AIPerf (the load tool Dynamo users run) against splitserve and plain vLLM, in one run.

Deployments, started in turn on the same model and stopped after their turn:
  1p1d        `splitserve up` (1 prefill + 1 decode, each engine on a core of its own)
  colocated   `splitserve up --prefill 0 --decode 0 --colocated 1`
  vllm        vLLM's own OpenAI server, its defaults but for the KV cache size and block size
              (`python -m vllm.entrypoints.openai.api_server`; bench/vs_vllm.py starts it)
Each runs in a session of its own, as a server started in one terminal and AIPerf in another do
(Linux shares CPU time between sessions first: splitserve/engine_spin.py says why it matters).
Each gets AIPerf's chat endpoint, streaming, at each concurrency. For splitserve the router's
own histograms (`/metrics`, scraped before and after) are read beside AIPerf's figures: the TTFT
p50 the router reports against the one the client measured.

AIPerf lives in a virtualenv of its own (`.venv-aiperf`, made on first use with
`pip install aiperf==0.13.0`), never a dependency of the project. It runs without
HF_HUB_OFFLINE: AIPerf 0.13 refuses a local tokenizer directory while it is set (no network is
needed for one).

    python bench/aiperf.py [--deployments 1p1d,colocated,vllm] [--concurrency 1,2]
                           [--requests 20] [--warmup 4] [--isl 128] [--osl 16] [--json FILE]
    python bench/aiperf.py --url http://127.0.0.1:8000 ...   # a server that is already up
    python bench/aiperf.py --concurrency 32 --requests 96 --warmup 0 --isl 256 --osl 32 \
                           --repeats 3 --deployments 1p1d,colocated   # the burst: 0 errors?

Prints one row per deployment and concurrency: TTFT p50, ITL p50, latency p50 (ms), req/s,
errors, and for splitserve the router histogram's TTFT p50 and its ratio to AIPerf's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.host import machine
from bench.vs_vllm import start_vllm, stop_vllm
from deploy.procs import child_group
from splitserve.models import resolve_model

ROOT = Path(__file__).resolve().parents[1]
AIPERF_VENV = ROOT / ".venv-aiperf"
AIPERF = "aiperf==0.13.0"
SPLITSERVE = {"1p1d": [], "colocated": ["--prefill", "0", "--decode", "0", "--colocated", "1"]}


def aiperf_bin() -> Path:
    exe = AIPERF_VENV / "bin" / "aiperf"
    if not exe.exists():
        print(f"[aiperf] installing {AIPERF} into {AIPERF_VENV} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
        subprocess.run([str(AIPERF_VENV / "bin" / "pip"), "install", "-q", AIPERF], check=True)
    return exe


def wait_ready(url: str, path: str, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + path, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}{path} did not answer 200")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def buckets(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of histogram `name` (summed over labels)."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = out.get(float(le), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile over what was observed between two scrapes."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    if not counts or counts[-1] <= 0:
        return None
    rank, prev_le, prev_n = q * counts[-1], 0.0, 0.0
    for le, n in zip(les, counts):
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-12)
        prev_le, prev_n = le, n
    return None


def run_aiperf(url: str, model: str, tokenizer: str, conc: int, a: argparse.Namespace,
               out: Path, rep: int = 0) -> dict:
    """One AIPerf run; its prompts are new to the server (a seed of their own): none cached."""
    cmd = [str(aiperf_bin()), "profile", "--model", model, "--tokenizer", tokenizer,
           "--url", url, "--endpoint-type", "chat", "--streaming", "--concurrency", str(conc),
           "--request-count", str(a.requests), "--prompt-input-tokens-mean", str(a.isl),
           "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(a.osl),
           "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
           "--random-seed", str(a.seed + 1000 * rep + conc), "--ui", "none",
           "--output-artifact-dir", str(out)]
    if a.warmup:
        cmd += ["--warmup-request-count", str(a.warmup)]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    r = json.loads((out / "profile_export_aiperf.json").read_text())

    def p50(key: str) -> float | None:
        m = r.get(key) or {}
        return m.get("p50")

    errors = sum(e.get("count", 0) for e in r.get("error_summary") or [])
    rps = (r.get("request_throughput") or {}).get("avg")
    return {"ttft_ms": p50("time_to_first_token"), "itl_ms": p50("inter_token_latency"),
            "latency_ms": p50("request_latency"), "req_s": rps, "errors": errors}


def start_splitserve(name: str, model: str, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--model", model, "--http-port", str(port),
           "--grpc-port", "0", "--log-dir", str(log.parent / name), *SPLITSERVE[name]]
    return subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, **child_group(own_session=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="default: SmolLM2 (splitserve's default)")
    ap.add_argument("--deployments", default="1p1d,colocated,vllm")
    ap.add_argument("--url", default=None, help="drive this server instead of starting any")
    ap.add_argument("--concurrency", default="1,2")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="AIPerf runs per concurrency, in a "
                    "row on the same deployment (the burst check: three)")
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--dtype", default="float32", help="plain vLLM's (splitserve's: auto, which "
                    "is float32 for SmolLM2's float32 checkpoint)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = str(resolve_model(a.model))
    work = Path(tempfile.mkdtemp(prefix="splitserve-aiperf-"))
    concs = [int(c) for c in a.concurrency.split(",")]
    rows = []
    targets = [("given", a.url)] if a.url else [(d, None) for d in a.deployments.split(",")]
    for name, url in targets:
        proc = None
        if url is None:
            url = f"http://127.0.0.1:{a.port}"
            if name == "vllm":
                ns = argparse.Namespace(engine_cores="0", dtype=a.dtype, max_model_len=4096,
                                        vllm_port=a.port, kv_cache_mib=256, stream_interval=1)
                proc = start_vllm(ns, model, work / "vllm.log", own_session=True)
                wait_ready(url, "/v1/models")
            else:
                proc = start_splitserve(name, model, a.port, work / f"{name}.log")
                wait_ready(url, "/health")
        try:
            for conc, rep in [(c, k) for c in concs for k in range(a.repeats)]:
                splitserve = name != "vllm"
                before = scrape(url) if splitserve else ""
                r = run_aiperf(url, model, model, conc, a, work / f"{name}-c{conc}-{rep}", rep)
                if splitserve:
                    after = scrape(url)
                    h = "splitserve:time_to_first_token_seconds"
                    q = quantile(buckets(before, h), buckets(after, h), 0.5)
                    r["router_ttft_ms"] = None if q is None else 1000 * q
                rows.append({"deployment": name, "concurrency": conc, **r})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            if proc is not None:
                if name == "vllm":
                    stop_vllm(proc)
                else:
                    proc.send_signal(2)
                    proc.wait(120)
    print(f"\nAIPerf 0.13, chat, streaming, {a.isl} in / {a.osl} out, {a.warmup} warm-up + "
          f"{a.requests} requests; model {a.model}; {machine()}")
    print(f"{'deployment':<11}{'conc':>5}{'TTFT p50':>10}{'ITL p50':>9}{'lat p50':>9}"
          f"{'req/s':>7}{'errors':>7}{'router TTFT p50':>17}{'router/AIPerf':>14}")

    def fmt(v, spec: str) -> str:
        return format("-", ">" + spec.split(".")[0]) if v is None else format(v, spec)

    for r in rows:
        rt = r.get("router_ttft_ms")
        ratio = rt / r["ttft_ms"] if rt and r["ttft_ms"] else None
        print(f"{r['deployment']:<11}{r['concurrency']:>5}{fmt(r['ttft_ms'], '10.0f')}"
              f"{fmt(r['itl_ms'], '9.1f')}{fmt(r['latency_ms'], '9.0f')}{fmt(r['req_s'], '7.2f')}"
              f"{fmt(r['errors'], '7.0f')}{fmt(rt, '17.0f')}{fmt(ratio, '14.2f')}")
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    print(f"[aiperf] artifacts and logs: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
