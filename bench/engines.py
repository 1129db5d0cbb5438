"""Drive real vLLM engines in-process: exact-length prompts, greedy generation on one engine,
and the disaggregated pull protocol between two (prefill → ticket → decode). Shared by the
tests (tests/utils.py) and the benchmarks that compare engine configurations directly."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from tokenizers import Tokenizer

from splitserve.engine import EngineConfig, build_engine, stop_engine, token_prompt
from splitserve.tiny_tokenizer import synth_corpus


def make_prompts(model_dir: Path, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of exactly the given lengths (BOS first), from varied synthetic text."""
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    rng = random.Random(seed)
    lines = synth_corpus(seed + 1000, num_lines=3000)
    prompts = []
    for n in lengths:
        ids = tok.encode(" ".join(rng.sample(lines, 400))).ids  # starts with BOS
        assert len(ids) >= n, f"not enough text for a {n}-token prompt"
        prompts.append(ids[:n])
    return prompts


async def engine_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of all prompts, submitted concurrently to one AsyncLLM."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    async def one(i: int, ids: list[int]) -> list[int]:
        final = None
        async for out in engine.generate(token_prompt(ids), params, request_id=f"g{i}"):
            final = out
        return list(final.outputs[0].token_ids)

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


class LoopThread:
    """One asyncio loop in a thread, shared by a module's tests.

    An AsyncLLM binds to the loop that first drives it, so engines shared across tests must live
    on one loop that outlives each test; tests submit coroutines with `run`.
    """

    def __init__(self) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 300.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def collect(engine, prompt_ids: list[int], params, request_id: str):
    """Run one request to the end; return the final RequestOutput."""
    final = None
    async for out in engine.generate(token_prompt(prompt_ids), params,
                                     request_id=request_id):
        final = out
    return final


async def disagg_greedy(prefill, decode, ids: list[int], max_tokens: int, request_id: str,
                        decode_params: dict | None = None, rewrite=None
                        ) -> tuple[list[int], str | None]:
    """Prefill on one engine, pull the KV into the other, decode there: the pull protocol.
    `rewrite(ticket)` changes the ticket on its way; `decode_params` adds keys (fault injection)."""
    from vllm import SamplingParams

    from splitserve.kv.ticket import KVTicket, produce_params

    p = SamplingParams(temperature=0.0, max_tokens=1,
                       extra_args={"kv_transfer_params": produce_params(f"{request_id}-t")})
    out = await collect(prefill, ids, p, f"{request_id}-p")
    first = out.outputs[0].token_ids[0]
    ticket = KVTicket.from_vllm(out.kv_transfer_params)
    assert ticket.transfer_id == f"{request_id}-t"  # the caller's id names the transfer
    if rewrite is not None:
        ticket = rewrite(ticket)
    kv = {**ticket.to_vllm(), **(decode_params or {})}
    d = SamplingParams(temperature=0.0, max_tokens=max_tokens - 1,
                       extra_args={"kv_transfer_params": kv})
    out = await collect(decode, ids + [first], d, f"{request_id}-d")
    return [first, *out.outputs[0].token_ids], out.outputs[0].finish_reason


async def wait_idle(monitor, timeout: float = 30.0) -> None:
    """Until the engine reports no running/waiting requests and no KV blocks in use."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        s = monitor.snapshot()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {s}")
        await asyncio.sleep(0.05)


class EngineSet:
    """Named engines, each with its EngineMonitor, all driven on one LoopThread (an AsyncLLM
    stays on the loop that first drove it).

    Built two at a time, in the order given, each of a pair on a core of its own where its
    config leaves the cores to vLLM ("auto", which would bind both to the first core): most of a
    start is two processes importing vLLM, or a compile, and more than one per core only makes
    each slower. A pair is built after the one before it is up, so an engine whose compiled
    forward the later ones load from the compile cache (a producer before its consumers) goes
    in an earlier pair. Seven engines started in 167 s one after the other (2-core CI host, cold
    compile cache)."""

    def __init__(self, configs: dict[str, EngineConfig]) -> None:
        from splitserve.engine_stats import EngineMonitor

        self.loop = LoopThread()
        self.monitors = {name: EngineMonitor() for name in configs}
        self.engines: dict = {}
        names = list(configs)
        try:
            for i in range(0, len(names), 2):
                pair = {n: _placed(configs[n], k) for k, n in enumerate(names[i:i + 2])}
                self.engines.update(_build_pair(pair, self.monitors))
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str):
        return self.engines[name]

    def run(self, coro, timeout: float = 300.0):
        return self.loop.run(coro, timeout)

    def assert_idle(self) -> None:
        """Every engine idle with no KV block in use: the leak check after a test."""
        async def all_idle() -> None:
            await asyncio.gather(*(wait_idle(m) for m in self.monitors.values()))

        self.run(all_idle())

    def close(self) -> None:
        import gc
        from concurrent.futures import ThreadPoolExecutor

        # All at once: most of an engine's shutdown is waiting for its processes to exit (one
        # after the other, seven engines took 27 s to stop).
        if self.engines:
            with ThreadPoolExecutor(len(self.engines)) as pool:
                list(pool.map(stop_engine, self.engines.values()))
        # Collected now, while everything is importable: AsyncLLM.__del__ shuts down again, and
        # left to interpreter teardown it trips over half-unloaded modules.
        self.engines.clear()
        gc.collect()
        self.loop.close()


def _placed(cfg: EngineConfig, index: int) -> EngineConfig:
    from dataclasses import replace

    from splitserve.engine import spread_cores

    return replace(cfg, cpu_cores=spread_cores(index)) if cfg.cpu_cores == "auto" else cfg


def _engine_core_spawned(before: set[int]) -> bool:
    """A child process of ours that multiprocessing spawned since `before` (an engine's
    EngineCore, which took its environment from ours when it started)."""
    import psutil

    for child in psutil.Process().children():
        try:
            if child.pid not in before and "spawn_main" in " ".join(child.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


def _build_pair(configs: dict[str, EngineConfig], monitors: dict) -> dict:
    """Start the engines of `configs` at once (off the loop: an AsyncLLM started with no
    running loop binds its output handler to the loop of its first request).

    build_engine hands an engine its settings through our environment (its cores among them),
    which its EngineCore process copies when it is spawned: the next engine's build starts once
    the one before it has spawned its EngineCore."""
    import threading
    import time

    import psutil

    built: dict = {}
    errors: list[BaseException] = []

    def build(name: str) -> None:
        try:
            built[name] = build_engine(configs[name], monitors[name])
        except BaseException as e:  # re-raised below, after the other build has ended
            errors.append(e)

    threads = []
    for name in configs:
        before = {c.pid for c in psutil.Process().children()}
        t = threading.Thread(target=build, args=(name,), daemon=True)
        t.start()
        threads.append(t)
        while t.is_alive() and not _engine_core_spawned(before):
            time.sleep(0.05)
    for t in threads:
        t.join()
    if errors:
        for engine in built.values():
            stop_engine(engine)
        raise errors[0]
    return built
