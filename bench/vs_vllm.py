"""Plain vLLM against splitserve on one host and one workload: what splitserve's layers cost.

Deployments, both up for the whole run (only the one under test gets load):
  vllm        vLLM's own OpenAI server, one engine (`python -m vllm.entrypoints.openai.api_server`)
  splitserve  the router's OpenAI front + one colocated worker (what `splitserve up --prefill 0
              --decode 0 --colocated 1` starts, placed as `up` places it)
Both engines: same model, dtype, KV cache bytes, block size, context length, prefix caching, and
the same engine core(s). Drivers: vLLM's `vllm bench serve` (bench/vllm_driver.py) and
`splitserve bench`, both against the OpenAI HTTP front. For every rate, repeat and driver the two
deployments run back to back (order alternating) on the same fresh random prompts: one seed per
run, so no prefix-cache help and an identical workload for both. The drivers run on the cores
the engine does not use, for both deployments.

    python bench/vs_vllm.py [--rates 1,2] [--repeats 2] [--num-prompts 40] [--json FILE]
                            [--profile DIR]

--profile DIR records py-spy flame graphs (SVG; py-spy from the package registry) of both
deployments' server processes, engines included, during the first repeat at the highest rate.

Prints, per rate and driver, the median over repeats of SLO attainment, goodput and TTFT/TPOT
percentiles for each deployment, and the ratios splitserve / vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.host import machine
from deploy.placement import free_cores, pin_serving
from deploy.procs import ProcessSet, child_group
from splitserve.models import resolve_model
from splitserve.roles import Role
from splitserve.slo import SLO

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("attainment", "goodput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "completed")


def start_vllm(a: argparse.Namespace, model: str, log: Path,
               own_session: bool = False) -> subprocess.Popen:
    """In our session, as splitserve's components are (deploy/procs.py says why), unless
    `own_session`."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": a.engine_cores}
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--dtype", a.dtype, "--max-model-len", str(a.max_model_len), "--port", str(a.vllm_port),
         "--kv-cache-memory-bytes", str(a.kv_cache_mib << 20), "--block-size", "128",
         "--max-num-seqs", "64", "--seed", "0",
         "--stream-interval", str(a.stream_interval)],
        env=env, stdin=subprocess.DEVNULL, stdout=open(log, "w"), stderr=subprocess.STDOUT,
        **child_group(own_session))


def start_splitserve(a: argparse.Namespace, model: str, procs: ProcessSet) -> str:
    router = procs.spawn("router", ["router", "--model", model, "--grpc-port", "0",
                                    "--http-port", str(a.splitserve_port),
                                    "--max-model-len", str(a.max_model_len),
                                    "--stream-interval", str(a.stream_interval)])
    procs.wait_ready([router], 120)
    worker = procs.spawn("colocated", [
        "colocated", "--model", model, "--router", router.address, "--dtype", a.dtype,
        "--max-model-len", str(a.max_model_len), "--kv-cache-mib", str(a.kv_cache_mib),
        "--cpu-cores", a.engine_cores], Role.COLOCATED)
    procs.wait_ready([worker], 900)
    pin_serving([router.popen.pid, worker.popen.pid], [a.engine_cores])
    return router.endpoints["http"]


def stop_vllm(p: subprocess.Popen) -> None:
    """vLLM's server and its engine (its own process group: killed as one if it will not
    stop)."""
    p.terminate()
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)


def wait_http(url: str, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not come up")


def drive(driver: str, url: str, model: str, rate: float, seed: int, a: argparse.Namespace,
          out: Path, cores: set[int] | None = None) -> dict:
    """One drive of `driver` against `url`; `cores`: where the load generator may run (none:
    anywhere)."""
    lo, hi = a.input_len * (1 - a.range_ratio), a.input_len * (1 + a.range_ratio)
    olo, ohi = a.output_len * (1 - a.range_ratio), a.output_len * (1 + a.range_ratio)
    slo = SLO(ttft_s=a.slo_ttft_s, tpot_s=a.slo_tpot_s)
    if driver == "vllm":
        cmd = [sys.executable, "-m", "bench.vllm_driver", "--result-json", str(out), "--",
               "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
               "--model", model, "--dataset-name", "random", "--random-input-len",
               str(a.input_len), "--random-output-len", str(a.output_len),
               "--random-range-ratio", str(a.range_ratio), "--num-prompts", str(a.num_prompts),
               "--request-rate", str(rate), "--ignore-eos", "--seed", str(seed),
               # vLLM's --goodput takes bare milliseconds
               "--goodput", f"ttft:{slo.ttft_s * 1e3:g}", f"tpot:{slo.tpot_s * 1e3:g}",
               "--disable-tqdm"]
    else:
        cmd = [sys.executable, "-m", "deploy.cli", "bench", "--http-url", url, "--model", model,
               "--model-name", model, "--num-prompts", str(a.num_prompts),
               "--input-len", f"uniform:{lo:.0f}-{hi:.0f}",
               "--output-len", f"uniform:{olo:.0f}-{ohi:.0f}", "--rate", str(rate),
               "--seed", str(seed), "--slo", str(slo), "--no-progress",
               "--result-json", str(out)]
        if a.long_fraction:
            cmd += ["--long-fraction", str(a.long_fraction), "--long-input-len",
                    a.long_input_len, "--long-output-len", a.long_output_len]
    # The load generator stays in our session, with the deployment (deploy/procs.py says why
    # sessions matter): in a session of its own, the busy engines' spinning waits starved it
    # (1P+1D's streams then arrived whole; docs/benchmarks.md, "One session for the whole
    # cluster").
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if cores:  # before its threads start: they inherit it
        os.sched_setaffinity(p.pid, cores)
    if p.wait() != 0:
        raise subprocess.CalledProcessError(p.returncode, cmd)
    r = json.loads(out.read_text())
    if driver == "vllm":
        done = r["completed"]
        good = r.get("request_goodput") or 0.0
        return {"attainment": good / r["request_throughput"] if done else 0.0, "goodput": good,
                "completed": done, **{k: r[k] for k in METRICS[2:6]}}
    return {"attainment": r["slo_attainment"], "goodput": r["slo_attainment"] *
            r["request_throughput"], "completed": r["completed"],
            **{k: r[k] for k in METRICS[2:6]}, "requests": r["runs"][0]["requests"]}


def workload_arguments(ap: argparse.ArgumentParser) -> None:
    """The workload, SLO, drivers and engine sizes `drive` and `start_vllm` read (also
    bench/goodput.py's)."""
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=1536)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.333)
    ap.add_argument("--long-fraction", type=float, default=0.0,
                    help="share of long-document requests mixed in (the mixed workload: "
                         "`splitserve bench` only, vLLM's random dataset draws one length range)")
    ap.add_argument("--long-input-len", default="uniform:1024-2048")
    ap.add_argument("--long-output-len", default="fixed:16")
    ap.add_argument("--slo-ttft-s", type=float, default=1.0, help="seconds")
    ap.add_argument("--slo-tpot-s", type=float, default=0.025, help="seconds")
    # Retired milliseconds spellings (still in benchmarks-log.md's commands): refused by name.
    ap.add_argument("--slo-ttft-ms", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--slo-tpot-ms", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--drivers", default="vllm,splitserve")
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--vllm-port", type=int, default=8100)
    ap.add_argument("--splitserve-port", type=int, default=8200)
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tokens per streamed message, at least, for both servers (vLLM's "
                         "--stream-interval and the router's)")


def check_workload(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse, before anything starts, what `drive` cannot run."""
    for metric in ("ttft", "tpot"):
        ms = getattr(a, f"slo_{metric}_ms")
        if ms is not None:
            ap.error(f"--slo-{metric}-ms is gone: durations are seconds, give "
                     f"--slo-{metric}-s {ms / 1e3:g}")
    try:
        SLO(a.slo_ttft_s, a.slo_tpot_s)
    except ValueError as e:
        ap.error(str(e))
    if a.long_fraction and "vllm" in a.drivers.split(","):
        ap.error("--long-fraction: `vllm bench serve` cannot draw a mixture; add "
                 "--drivers splitserve")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="default: the generated tiny model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rates", default="1,2")
    ap.add_argument("--repeats", type=int, default=2)
    workload_arguments(ap)
    ap.add_argument("--engine-cores", default="0", help="the engine's cores, for both")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="write py-spy flame graphs (SVG) here")
    a = ap.parse_args()
    check_workload(ap, a)
    model = resolve_model(a.model)
    tmp = Path(tempfile.mkdtemp(prefix="splitserve-vs-vllm-"))
    procs = ProcessSet(log_dir=tmp)
    vllm = start_vllm(a, model, tmp / "vllm.log")
    rows: list[dict] = []
    try:
        urls = {"splitserve": start_splitserve(a, model, procs)}
        wait_http(f"http://127.0.0.1:{a.vllm_port}")
        urls["vllm"] = f"http://127.0.0.1:{a.vllm_port}"
        pids = {"vllm": {"api-server": vllm.pid},
                "splitserve": {p.name: p.popen.pid for p in procs.procs}}
        # The load generator stays off the engine's core for both deployments: where the
        # scheduler put it there, it took slices of the engine's steps, a cost neither server
        # would pay with its clients on other hosts. It shares the rest with the serving
        # processes (splitserve's pinned there, vLLM's free).
        client_cores = free_cores([a.engine_cores])
        seed = a.seed
        rates = [float(r) for r in a.rates.split(",")]
        for rate in rates:
            for rep in range(a.repeats):
                for driver in a.drivers.split(","):
                    seed += 1
                    order = ["vllm", "splitserve"] if seed % 2 else ["splitserve", "vllm"]
                    for dep in order:
                        prof = (a.profile and rep == 0 and rate == max(rates)
                                and driver == a.drivers.split(",")[0])
                        spies = profile(pids[dep], Path(a.profile), f"{dep}-rate{rate:g}") \
                            if prof else []
                        r = drive(driver, urls[dep], model, rate, seed, a,
                                  tmp / f"{dep}-{driver}-{rate}-{rep}.json", client_cores)
                        stop_profile(spies)
                        rows.append({"deployment": dep, "driver": driver, "rate": rate,
                                     "repeat": rep, "seed": seed, **r})
                        print(f"rate {rate:g} rep {rep} {driver:10} {dep:10} attainment "
                              f"{r['attainment']:.0%} TTFT p50 {r['median_ttft_ms']:.0f} ms "
                              f"TPOT p50 {r['median_tpot_ms']:.1f} ms", file=sys.stderr,
                              flush=True)
    finally:
        procs.stop(15)
        stop_vllm(vllm)
    table = summarize(rows)
    print(table)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"machine": machine(), "args": vars(a),
                                            "rows": rows}, indent=2) + "\n")


def profile(pids: dict[str, int], out: Path, tag: str) -> list[subprocess.Popen]:
    """One sampling profiler per server process, its engine processes included."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([spy, "record", "--nonblocking", "--subprocesses", "--rate", "100",
                              "--pid", str(pid), "--format", "flamegraph",
                              "--output", str(out / f"{tag}-{name}.svg")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()]


def stop_profile(spies: list[subprocess.Popen]) -> None:
    for p in spies:
        p.send_signal(signal.SIGINT)  # py-spy writes its flame graph on SIGINT
    for p in spies:
        p.wait(60)


def summarize(rows: list[dict]) -> str:
    keys = sorted({(r["driver"], r["rate"]) for r in rows})
    head = (f"{'driver':10} {'rate':>5} {'deployment':11} {'attain':>7} {'goodput':>8} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
    lines = [head]
    for driver, rate in keys:
        med = {}
        for dep in ("vllm", "splitserve"):
            rs = [r for r in rows if (r["driver"], r["rate"], r["deployment"]) ==
                  (driver, rate, dep)]
            med[dep] = {k: statistics.median(r[k] for r in rs) for k in METRICS}
            m = med[dep]
            lines.append(f"{driver:10} {rate:5g} {dep:11} {m['attainment']:7.0%} "
                         f"{m['goodput']:8.2f} {m['median_ttft_ms']:9.0f} "
                         f"{m['p99_ttft_ms']:9.0f} {m['median_tpot_ms']:9.1f} "
                         f"{m['p99_tpot_ms']:9.1f}")
        ratios = [_ratio(med["splitserve"][k], med["vllm"][k]) for k in METRICS[:6]]
        lines.append(f"{driver:10} {rate:5g} {'ss / vllm':11} {ratios[0]:>7} {ratios[1]:>8} "
                     + " ".join(f"{x:>9}" for x in ratios[2:]))
    return "\n".join(lines)


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "n/a"


if __name__ == "__main__":
    main()
