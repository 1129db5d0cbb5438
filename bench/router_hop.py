"""What one relay hop costs in time to first token, and what the router adds on top of it.

The same short request (2 output tokens) goes three ways, one after another in rotating order,
so machine noise hits all three alike:
  direct   DecodeWorker.Decode on a stand-in worker (bench/token_source.py: no engine)
  relay    through bench/relay.py: the least a router can be (the call, one session message
           each way, the chunks back)
  router   through the router (validation, admission, routing, detokenisation, metrics)
Overheads are medians of paired differences against the direct request of the same round. The
relay's is the floor: a router built on gRPC's asyncio stack pays it before doing anything.
Placed as bench/router_throughput.py places them: router and relay on one core, the source and
this client on the others. Prints a table per prompt length; --json FILE writes the numbers.
`--baseline DIR` adds a fourth path: a router run from another checkout (e.g. a `git worktree`
of main), in the same rotation, so a change to the router is measured against it side by side
rather than across runs, whose spread (±0.1 ms here) is larger than most such changes.

    python -m bench.router_hop [--rounds 300] [--prompt-lens 64 1500] [--baseline DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import grpc

from bench.router_overhead import timed
from deploy.procs import ProcessSet
from splitserve.models import resolve_model
from splitserve.roles import Role
from splitserve.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

PATHS = ("direct", "relay", "router")


def measure(model: str | None, prompt_lens: list[int], rounds: int,
            warmup: int = 30, baseline: str | None = None) -> list[dict]:
    model = resolve_model(model)
    mine = os.sched_getaffinity(0)
    front = {min(mine)} if len(mine) > 1 else mine
    others = mine - front or mine
    cluster = ProcessSet()
    try:
        src = cluster.spawn("token-source", ["--model-name", Path(model).name], Role.COLOCATED,
                            module="bench.token_source")
        cluster.wait_ready([src], 60)
        os.sched_setaffinity(src.popen.pid, others)
        relay = cluster.spawn("relay", ["--worker", src.address], module="bench.relay")
        args = ["router", "--model", model, "--grpc-port", "0", "--http-port", "0",
                "--static-colocated", src.address]
        routers = {"router": cluster.spawn("router", args)}
        if baseline is not None:
            # PYTHONSAFEPATH: `python -m` would put this directory first on the path otherwise.
            env = {**os.environ, "PYTHONPATH": str(Path(baseline).resolve()), "PYTHONSAFEPATH": "1"}
            routers["baseline"] = cluster.spawn("baseline", args, env=env)
        for p in (relay, *routers.values()):
            os.sched_setaffinity(p.popen.pid, front)  # before their threads start
        cluster.wait_ready([relay, *routers.values()], 60)
        os.sched_setaffinity(0, others)
        return [_one_length(src.address, relay.address,
                            {k: p.address for k, p in routers.items()}, n, rounds, warmup)
                for n in prompt_lens]
    finally:
        os.sched_setaffinity(0, mine)
        cluster.stop(grace_s=10)


def _one_length(source: str, relay: str, routers: dict[str, str], prompt_len: int, rounds: int,
                warmup: int) -> dict:
    sp = common_pb2.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = [5 + i % 1000 for i in range(prompt_len)]
    paths = (*PATHS, *(k for k in routers if k not in PATHS))
    ttft: dict[str, list[float]] = {p: [] for p in paths}
    channels = {"direct": source, "relay": relay, **routers}
    with contextlib.ExitStack() as stack:
        ch = {p: stack.enter_context(grpc.insecure_channel(a)) for p, a in channels.items()}
        direct = worker_pb2_grpc.DecodeWorkerStub(ch["direct"]).Decode
        gen = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt),
                                             sampling=sp)
        calls = {"direct": lambda i: direct(worker_pb2.DecodeRequest(
            request_id=f"d{prompt_len}-{i}", prompt_token_ids=prompt, sampling=sp), timeout=30)}
        for p in paths[1:]:
            stub = generation_pb2_grpc.GenerationStub(ch[p]).Generate
            calls[p] = lambda i, stub=stub: stub(gen, timeout=30)
        for p in routers:
            _until_routable(lambda p=p: calls[p](0))
        for i in range(warmup + rounds):
            for k in range(len(paths)):  # rotate who goes first
                path = paths[(i + k) % len(paths)]
                t, _ = timed(lambda p=path, i=i: calls[p](i))
                if i >= warmup:
                    ttft[path].append(t)

    def over(path: str, base: str) -> float:
        return statistics.median(b - a for a, b in zip(ttft[base], ttft[path])) * 1e3

    row = {"prompt_len": prompt_len, "rounds": rounds,
           "ttft_ms": {p: statistics.median(v) * 1e3 for p, v in ttft.items()},
           "relay_adds_ms": over("relay", "direct"), "router_adds_ms": over("router", "direct"),
           "router_over_relay_ms": over("router", "relay")}
    if "baseline" in routers:
        row["baseline_adds_ms"] = over("baseline", "direct")
        row["router_over_baseline_ms"] = over("router", "baseline")
    return row


def _until_routable(call) -> None:
    """The router learns its static worker by polling it; until then it refuses requests."""
    deadline = time.monotonic() + 60
    while True:
        try:
            for _ in call():
                pass
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def report(rows: list[dict]) -> None:
    print(f"{'prompt':>6} {'direct TTFT ms':>14} {'relay adds ms':>13} {'router adds ms':>14} "
          f"{'router - relay ms':>17}"
          + (f" {'baseline adds ms':>16} {'router - baseline ms':>20}" if "baseline_adds_ms"
             in rows[0] else "") + "   (medians of paired differences)")
    for r in rows:
        print(f"{r['prompt_len']:6d} {r['ttft_ms']['direct']:14.3f} {r['relay_adds_ms']:+13.3f} "
              f"{r['router_adds_ms']:+14.3f} {r['router_over_relay_ms']:+17.3f}"
              + (f" {r['baseline_adds_ms']:+16.3f} {r['router_over_baseline_ms']:+20.3f}"
                 if "baseline_adds_ms" in r else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="the tokenizer the router loads")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 1500])
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also measure the router of this checkout (its PYTHONPATH), side by side")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = measure(a.model, a.prompt_lens, a.rounds, baseline=a.baseline)
    report(rows)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
