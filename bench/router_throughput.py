"""How many streamed tokens the router relays per second of its own CPU.

A real engine on a small host makes a few hundred tokens a second, far too few to load the router,
so the router here fronts `bench.token_source` (a stand-in decode worker that streams token ids as
fast as it is asked) and clients pull long streams through it: over gRPC with detokenisation (what
the text API does) and over the OpenAI HTTP front (SSE). The router's CPU time (all its threads,
from /proc) divided by the tokens it delivered is the cost per token; its inverse is the tokens
one core relays per second. With two or more CPUs the router gets one to itself and the source and
the clients share the others, so the clients' own cost does not count against it.

Nearly all of the cost is per message, not per token (gRPC's read and write, the event loop's
wake-ups), so each configuration runs at every `--stream-interval` given: the requests' own
`sampling.stream_interval`, which the source honours as an engine does (the first token alone,
then batches of that many).

    python -m bench.router_throughput [--concurrency 1 32] [--stream-interval 1 2] [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.client import GrpcTarget, HttpTarget, run_load
from bench.workload import RequestSpec
from deploy.procs import ProcessSet
from splitserve.models import resolve_model
from splitserve.procstat import proc_stat
from splitserve.roles import Role

PROMPT = tuple(range(5, 69))


@dataclass
class Throughput:
    api: str  # "grpc" (text) or "http"
    concurrency: int
    stream_interval: int
    tokens: int
    wall_s: float
    router_cpu_s: float

    @property
    def us_per_token(self) -> float:
        return self.router_cpu_s / max(self.tokens, 1) * 1e6

    @property
    def tokens_per_core_s(self) -> float:
        return self.tokens / max(self.router_cpu_s, 1e-9)

    @property
    def router_busy(self) -> float:
        """Share of its core the router used: near 1 when it is what limits the rate, so the
        row measures its capacity; lower when the source or the clients are the limit."""
        return self.router_cpu_s / max(self.wall_s, 1e-9)

    def row(self) -> dict:
        return {**asdict(self), "us_per_token": self.us_per_token,
                "tokens_per_core_s": self.tokens_per_core_s, "router_busy": self.router_busy}


def cpu_seconds(pid: int) -> float:
    """User + system time of every thread of `pid` so far."""
    st = proc_stat(pid)
    if st is None:
        raise ProcessLookupError(pid)
    return st.cpu_s


def measure(model: str | None, concurrencies: list[int], seconds: float,
            tokens_per_request: int, intervals: tuple[int, ...] = (1,)) -> list[Throughput]:
    model = resolve_model(model)
    served = Path(model).name  # what the router calls the model of the directory it loads
    mine = os.sched_getaffinity(0)
    router_cpu = {min(mine)} if len(mine) > 1 else mine
    others = mine - router_cpu or mine
    cluster = ProcessSet()
    try:
        src = cluster.spawn("token-source", ["--model-name", served], Role.COLOCATED,
                            module="bench.token_source")
        cluster.wait_ready([src], 60)
        os.sched_setaffinity(src.popen.pid, others)
        r = cluster.spawn("router", ["router", "--model", model, "--grpc-port", "0",
                                     "--http-port", "0", "--static-colocated", src.address])
        os.sched_setaffinity(r.popen.pid, router_cpu)  # before its threads start
        cluster.wait_ready([r], 60)
        os.sched_setaffinity(0, others)
        return asyncio.run(_all(r.endpoints, served, r.popen.pid, concurrencies, seconds,
                                tokens_per_request, intervals))
    finally:
        os.sched_setaffinity(0, mine)
        cluster.stop(grace_s=10)


async def _all(endpoints: dict[str, str], model: str, pid: int, concurrencies: list[int],
               seconds: float, n: int, intervals: tuple[int, ...]) -> list[Throughput]:
    out = []
    for api in ("grpc", "http"):
        for k in intervals:
            target = (GrpcTarget(endpoints["grpc"], detokenize=True, timeout_s=60,
                                 stream_interval=k) if api == "grpc"
                      else HttpTarget(endpoints["http"], model, timeout_s=60, stream_interval=k))
            try:
                await _until_routable(target)
                await run_load(target, [RequestSpec(PROMPT, None, 16)] * 4, None, 4, False)
                for conc in concurrencies:
                    out.append(await _one(api, k, target, pid, conc, seconds, n))
            finally:
                await target.close()
    return out


async def _until_routable(target: GrpcTarget | HttpTarget) -> None:
    """The router learns its static worker by polling it; until then requests are refused."""
    deadline = time.monotonic() + 60
    while not (await target.send(RequestSpec(PROMPT, None, 2))).ok:
        if time.monotonic() > deadline:
            raise TimeoutError("the router never routed to the token source")
        await asyncio.sleep(0.5)


async def _one(api: str, interval: int, target, pid: int, conc: int, seconds: float,
               n: int) -> Throughput:
    """Closed loop at `conc` streams for about `seconds`: each stream asks `n` tokens at a time,
    and the number of requests is sized from a short probe of this path's rate."""
    spec = RequestSpec(PROMPT, None, n)
    t0 = time.perf_counter()
    probe, _ = await run_load(target, [spec] * conc, None, conc, False)
    per_s = conc / max(time.perf_counter() - t0, 1e-3)
    specs = [spec] * max(conc, round(per_s * seconds))
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    results, _ = await run_load(target, specs, None, conc, False)
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - c0
    failed = [r.error for r in results + probe if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed over {api}: {failed[0]}")
    if interval > 1 and any(len(r.chunk_tokens) >= n for r in results):
        raise RuntimeError(f"stream interval {interval} over {api}: a request came in a message "
                           f"per token")  # the router or the source ignored the interval
    return Throughput(api, conc, interval, sum(r.output_tokens for r in results), wall, cpu)


def report(rows: list[Throughput]) -> None:
    print(f"{'api':5} {'streams':>7} {'interval':>8} {'tokens':>8} {'wall s':>7} "
          f"{'router CPU s':>12} {'busy':>5} {'us/token':>9} {'tokens per core-s':>18}")
    for t in rows:
        print(f"{t.api:5} {t.concurrency:7d} {t.stream_interval:8d} {t.tokens:8d} {t.wall_s:7.1f} "
              f"{t.router_cpu_s:12.2f} {t.router_busy:5.0%} {t.us_per_token:9.1f} "
              f"{t.tokens_per_core_s:18.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="the tokenizer the router loads")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    ap.add_argument("--stream-interval", type=int, nargs="+", default=[1, 2],
                    help="the requests' sampling.stream_interval, each in turn")
    a = ap.parse_args()
    report(measure(a.model, a.concurrency, a.seconds, a.tokens, tuple(a.stream_interval)))


if __name__ == "__main__":
    main()
