"""The connector inside real vLLM engines (CPU, separate engine processes, real gloo).

Engines, shared by the module (starting one costs ~15 s on 2 cores):
  P   producer (prefill), short lease so the expiry test is quick; copies held blocks out
  PB  the same, holding vLLM's blocks until pulled (the GPU default)
      (both publish their transfer counts on a status board: board.py)
  D   consumer, kv_load_failure_policy "recompute"
  DF  consumer, policy "fail"
  DS  consumer, loads in the step that schedules the request, before its forward pass
  DL  the same, but scattering each layer beside the forward (layered.py), slowed down so that
      a forward that did not wait for its layer would read it unfilled (every engine runs
      with the faults of FAULTS: a consumer honours a request's "corrupt", a layered helper
      is slow; nothing else here stalls)
  C   plain colocated engine: the reference every disaggregated output must equal
P, D, DS, DL and C run compiled, as vLLM does by default (splitserve/compilation.py): the golden
test is the proof that the connector's hooks, the layered load's per-layer wait among them,
work inside a compiled forward. PB and DF prove nothing about compiling, and start eagerly.
After every test all of them are idle with no KV block in use (leak check); after the module,
no shared-memory segment their processes made is left (counted by this module's tag: shm.py).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bench.kv_producer import ProducerProc
from splitserve.engine import EngineConfig
from splitserve.faults import FAULTS_ENV, Faults
from splitserve.kv import shm
from splitserve.kv.board import read_board
from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.ticket import KVTicket, produce_params
from tests.kv.transport_harness import HANG_S, wait_until
from tests.utils import (
    EAGER,
    GOLDEN_LENGTHS,
    EngineSet,
    collect,
    disagg_greedy,
    engine_greedy,
    make_prompts,
    wait_idle,
)

pytestmark = pytest.mark.slow
LEASE_S = 4.0
TIMEOUT_S = 5.0
MAX_TOKENS = 16
# DL's pause before scattering each layer: far longer than a forward pass of the tiny model.
LAYER_STALL_S = 0.05
FAULTS = Faults(corrupt_on_request=True, layer_stall_s=LAYER_STALL_S)


class Cluster(EngineSet):
    def __init__(self, model_dir: Path, board_dir: Path) -> None:
        self.model = str(model_dir)
        self.boards = {name: board_dir / f"{name}.board" for name in ("P", "PB")}
        base = {"model": self.model, "dtype": "float32", "kv_cache_mib": 128}
        kv = ConnectorSettings(lease_s=LEASE_S, timeout_s=TIMEOUT_S)
        # Built in pairs, in this order (bench/engines.py): P and C compile at once, each on a
        # core; the consumers then load P's compiled forward from the compile cache.
        super().__init__({
            "P": EngineConfig(**base, kv_role="kv_producer", engine_id="P",
                              kv_settings=replace(kv, status_file=str(self.boards["P"]))),
            "C": EngineConfig(**base),
            "D": EngineConfig(**base, kv_role="kv_consumer", engine_id="D",
                              kv_settings=replace(kv, load="async")),
            "DS": EngineConfig(**base, kv_role="kv_consumer", engine_id="DS",
                               kv_settings=replace(kv, load="sync")),
            "DL": EngineConfig(**base, kv_role="kv_consumer", engine_id="DL",
                               kv_settings=replace(kv, load="layered")),
            "PB": EngineConfig(**base, **EAGER, kv_role="kv_producer", engine_id="PB",
                               kv_settings=replace(kv, hold="blocks",
                                                   status_file=str(self.boards["PB"]))),
            # Async: test_producer_killed_mid_transfer watches DF's blocks while a pull is in
            # flight, and an in-step pull holds the step that would publish them.
            "DF": EngineConfig(**base, **EAGER, kv_role="kv_consumer", engine_id="DF",
                               kv_failure_policy="fail", kv_settings=replace(kv, load="async")),
        })

    def __getattr__(self, name: str):
        engines = self.__dict__.get("engines", {})
        if name in engines:
            return engines[name]
        raise AttributeError(name)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # The module's segments carry a tag of their own, inherited by the engines' processes (and
    # the fake producer's): the leak check counts those alone, not another splitserve's.
    tag = secrets.token_hex(4)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(shm.TAG_ENV, tag)
        env.setenv(FAULTS_ENV, FAULTS.to_env()[FAULTS_ENV])  # the engines inherit it
        c = Cluster(tiny_model_dir, tmp_path_factory.mktemp("boards"))
        yield c
        c.close()
    # The consumers unlinked their segments at shutdown, the producers their hold arenas.
    left = shm.leftover_segments(tag)
    assert not left, f"shared KV segments left behind: {left}"


@pytest.fixture(autouse=True)
def no_leaks(cluster: Cluster):
    yield
    cluster.assert_idle()


# D loads asynchronously (beside the engine's steps), DS in the step that schedules the request,
# before its forward pass reads the blocks, DL in that step beside its forward pass (a race
# there would show as wrong tokens).
LOADS = pytest.mark.parametrize("consumer", ["D", "DS", "DL"],
                                ids=["async-load", "in-step-load", "layered-load"])
IN_STEP = pytest.mark.parametrize("consumer", ["DS", "DL"], ids=["in-step-load", "layered-load"])


@LOADS
def test_golden_disaggregated_equals_colocated_under_concurrency(cluster: Cluster,
                                                                 consumer: str) -> None:
    for name in ("P", consumer, "C"):  # compiled, as the module's docstring says
        config = cluster.engines[name].vllm_config
        assert not config.model_config.enforce_eager, name
        assert config.compilation_config.mode.name != "NONE", name
    prompts = make_prompts(Path(cluster.model), GOLDEN_LENGTHS, seed=1)
    want = cluster.run(engine_greedy(cluster.C, prompts, MAX_TOKENS))

    async def all_disagg():
        return await asyncio.gather(*(
            disagg_greedy(cluster.P, cluster.engines[consumer], ids, MAX_TOKENS,
                          f"gold-{consumer}{i}")
            for i, ids in enumerate(prompts)))

    # One request first: the consumer's first pull connects it to P, which makes its shared
    # hold arena then (the holds after it land there).
    (warm,) = make_prompts(Path(cluster.model), [40], seed=101)  # none of the golden prefixes
    cluster.run(disagg_greedy(cluster.P, cluster.engines[consumer], warm, 2, f"warm-{consumer}"))
    before = cluster.monitors[consumer].snapshot().transfers
    got = cluster.run(all_disagg())
    for n, w, (g, _) in zip(GOLDEN_LENGTHS, want, got):
        assert g == w, f"{n}-token prompt: disaggregated {g} != colocated {w}"
    # Every prompt pulled its KV (the consumer computes only the first generated token's KV
    # itself), and on one host through shared memory, read straight out of the producer's
    # hold arena (the pair channel's golden run with real engines: tests/kv/test_fp8.py; the
    # consumer's own segment, bit-exact: tests/kv/test_transport.py).
    pulled = cluster.monitors[consumer].snapshot().transfers
    assert pulled.transfers - before.transfers == len(GOLDEN_LENGTHS)
    assert pulled.shm_transfers - before.shm_transfers == len(GOLDEN_LENGTHS)
    assert pulled.arena_transfers - before.arena_transfers == len(GOLDEN_LENGTHS)
    assert pulled.failures == 0 and pulled.bytes > 0
    # The consumer started after P and found P's compiled forward in the host's compile cache
    # (the KV role is not part of vLLM's cache key): on CPU only splitserve's vLLM plugin makes
    # that load work (splitserve/compilation.py); without it, it compiles again.
    assert cluster.run(cluster.engines[consumer].collective_rpc("splitserve_aot_loads")) == [1]


def test_layered_load_one_request_at_a_time(cluster: Cluster) -> None:
    """Alone in its step, every load is scattered beside the forward pass (under concurrency
    only a step's last load is). The prompts end mid-block: the step writes the first new
    token's K/V into the last pulled block before its layer's wait, so a scatter of that block
    after the write (with the others, a layer at a time) would overwrite it."""
    lengths = [1, 5, 17, 129, 200, 300, 511]  # none a multiple of the block size (128)
    prompts = make_prompts(Path(cluster.model), lengths, seed=7)
    want = cluster.run(engine_greedy(cluster.C, prompts, MAX_TOKENS))
    before = cluster.monitors["DL"].snapshot().transfers
    for n, ids, w in zip(lengths, prompts, want):
        got, _ = cluster.run(disagg_greedy(cluster.P, cluster.DL, ids, MAX_TOKENS, f"one-{n}"))
        assert got == w, f"{n}-token prompt: layered {got} != colocated {w}"
    after = cluster.monitors["DL"].snapshot().transfers
    assert after.transfers - before.transfers == len(lengths) and after.failures == before.failures


@IN_STEP
def test_a_failed_in_step_load_is_recomputed(cluster: Cluster, consumer: str) -> None:
    """The pull is refused (a transfer the producer never held): the connector reports the
    blocks as not loaded, vLLM recomputes them, and the answer is still right."""
    (ids,) = make_prompts(Path(cluster.model), [260], seed=13)
    want = cluster.run(engine_greedy(cluster.C, [ids], MAX_TOKENS))[0]
    failures = cluster.monitors[consumer].snapshot().transfers.failures
    tokens, reason = cluster.run(disagg_greedy(
        cluster.P, cluster.engines[consumer], ids, MAX_TOKENS, f"{consumer}-nohold",
        rewrite=lambda t: replace(t, transfer_id="never-held")))
    assert tokens == want and reason == "length"
    assert cluster.monitors[consumer].snapshot().transfers.failures == failures + 1


def test_consumer_prefix_cache_hit_shrinks_the_pull(cluster: Cluster) -> None:
    (ids,) = make_prompts(Path(cluster.model), [300], seed=2)
    want = cluster.run(engine_greedy(cluster.C, [ids], MAX_TOKENS))[0]
    mon = cluster.monitors["D"]
    b0 = mon.snapshot().transfers.bytes
    first = cluster.run(disagg_greedy(cluster.P, cluster.D, ids, MAX_TOKENS, "pc1"))[0]
    b1 = mon.snapshot().transfers.bytes - b0
    second = cluster.run(disagg_greedy(cluster.P, cluster.D, ids, MAX_TOKENS, "pc2"))[0]
    b2 = mon.snapshot().transfers.bytes - b0 - b1
    assert first == second == want
    # 300 tokens = 2 full blocks + a partial one. The second time D has the 2 full blocks in its
    # prefix cache and pulls only the partial last block: a third of the bytes.
    assert b1 > 0 and b2 * 3 == b1


@LOADS
def test_kv_really_travels_corrupted_bytes_change_the_output(cluster: Cluster,
                                                             consumer: str) -> None:
    d = cluster.engines[consumer]
    (ids,) = make_prompts(Path(cluster.model), [200], seed=3)
    want = cluster.run(engine_greedy(cluster.C, [ids], MAX_TOKENS))[0]
    clean = cluster.run(disagg_greedy(cluster.P, d, ids, MAX_TOKENS, f"clean-{consumer}"))[0]
    (ids2,) = make_prompts(Path(cluster.model), [200], seed=4)  # no prefix-cache help
    want2 = cluster.run(engine_greedy(cluster.C, [ids2], MAX_TOKENS))[0]
    bad = cluster.run(disagg_greedy(cluster.P, d, ids2, MAX_TOKENS, f"bad-{consumer}",
                                    decode_params={"fault": "corrupt"}))[0]
    assert clean == want
    assert bad[0] == want2[0]  # the first token comes from the prefill engine
    assert bad[1:] != want2[1:], "corrupting the pulled KV did not change the output"


@pytest.mark.parametrize("producer", ["P", "PB"])
def test_unpulled_lease_expires_and_a_late_pull_recomputes(cluster: Cluster,
                                                           producer: str) -> None:
    from vllm import SamplingParams

    board = cluster.boards[producer]

    def live() -> int:
        counts = read_board(board)
        return counts["held"] + counts["claimed"]

    # An earlier test's unpulled hold ends within a lease; then ours is the only one here.
    wait_until(lambda: live() == 0, "the producer's earlier holds to end")
    expired = read_board(board)["expired"]
    (ids,) = make_prompts(Path(cluster.model), [260], seed=5)
    want = cluster.run(engine_greedy(cluster.C, [ids], MAX_TOKENS))[0]
    p = SamplingParams(temperature=0.0, max_tokens=1,
                       extra_args={"kv_transfer_params": produce_params(f"lease-{producer}")})
    prod = cluster.engines[producer]
    out = cluster.run(collect(prod, ids, p, f"lease-{producer}"))
    params = out.kv_transfer_params
    ticket = KVTicket.from_vllm(params)
    assert len(ticket.block_ids) == 3  # 260 tokens: 2 full + partial
    mon = cluster.monitors[producer]
    if producer == "PB":
        assert mon.snapshot().kv_cache_usage > 0  # vLLM's blocks held under the lease
    # Nobody pulls or releases it: the producer ends it EXPIRED (its board counts it then).
    wait_until(lambda: read_board(board)["expired"] > expired and live() == 0, "the expiry")
    assert read_board(board)["expired"] == expired + 1
    # Not before the lease the ticket promised: the producer's lease starts when it registers
    # the hold, after the ticket was issued, so on a slow host this only gets later. 0.5 s:
    # the ticket's wall clock against the producer's monotonic one.
    assert time.time() >= ticket.lease_expires_at - 0.5
    # vLLM's blocks are free: at the hold when copied out, at the expiry otherwise.
    cluster.run(wait_idle(mon, timeout=HANG_S))
    # A decode that arrives too late is refused by the producer; policy "recompute" prefills
    # locally and the answer is still right.
    failures = cluster.monitors["D"].snapshot().transfers.failures
    d = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - 1,
                       extra_args={"kv_transfer_params": params})
    late = cluster.run(collect(cluster.D, ids + [out.outputs[0].token_ids[0]], d,
                               f"late-{producer}"))
    assert [out.outputs[0].token_ids[0], *late.outputs[0].token_ids] == want
    assert cluster.monitors["D"].snapshot().transfers.failures == failures + 1
    # The producer counted the expiry (its stats reach us with its next engine step).
    cluster.run(disagg_greedy(prod, cluster.D, ids[:50], 2, f"flush-{producer}"))
    assert mon.snapshot().transfers.lease_expired >= 1


def test_a_hold_does_not_wait_behind_the_next_prefill(cluster: Cluster) -> None:
    """A short prompt finishes its prefill in the step that starts a long one; the long one's
    rest is the next step. The short one's hold is registered before that step's forward pass,
    so its KV travels (a pull waits for the hold) and it decodes its second token while the
    long prompt is still prefilling. Registered after the forward (where vLLM calls
    start_load_kv), the hand-off would wait for the whole long prefill: broken that way once,
    this test failed."""
    from vllm import SamplingParams

    short, long = make_prompts(Path(cluster.model), [130, 3900], seed=21)
    want = cluster.run(engine_greedy(cluster.C, [short], 2))[0]
    pulls = cluster.monitors["D"].snapshot().transfers.transfers
    done: list[str] = []

    async def race() -> list[int]:
        async def handed_off() -> list[int]:
            tokens, _ = await disagg_greedy(cluster.P, cluster.D, short, 2, "behind-short")
            done.append("short decoded")
            return tokens

        async def prefill_long() -> None:
            await collect(cluster.P, long, SamplingParams(temperature=0.0, max_tokens=1),
                          "behind-long")
            done.append("long prefilled")

        tokens, _ = await asyncio.gather(handed_off(), prefill_long())
        return tokens

    assert cluster.run(race()) == want
    assert cluster.monitors["D"].snapshot().transfers.transfers == pulls + 1  # not recomputed
    assert done == ["short decoded", "long prefilled"]


def test_failure_policy_fail_ends_the_request_with_error(cluster: Cluster) -> None:
    (ids,) = make_prompts(Path(cluster.model), [140], seed=6)
    # A transfer id the producer never held: refused after its registration wait.
    tokens, reason = cluster.run(disagg_greedy(
        cluster.P, cluster.DF, ids, MAX_TOKENS, "nohold",
        rewrite=lambda t: replace(t, transfer_id="no-such-transfer")))
    assert reason == "error" and tokens[1:] == []


def test_producer_killed_mid_transfer(cluster: Cluster, tiny_model_dir: Path) -> None:
    """A producer process dies after accepting a pull: the decode engine fails the request
    (policy fail) instead of waiting on it, and every block it allocated returns to the pool.
    (That the consumer learns it from the broken connection, not by its timeout:
    test_transport.py, test_producer_killed_mid_transfer_fails_fast.)"""
    from vllm import SamplingParams

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    fake = ProducerProc(num_layers=cfg["num_hidden_layers"], num_blocks=8,
                        shape=[cfg["num_key_value_heads"], 128, 2 * head], dtype="float32",
                        model=cluster.model, block_size=128, timeout_s=TIMEOUT_S,
                        faults=Faults(stall_before_send_s=120.0))
    try:
        fake.cmd(op="hold", transfer_id="doomed", block_ids=[1, 2])
        (ids,) = make_prompts(Path(cluster.model), [200], seed=7)
        ticket = fake.ticket("doomed", [1, 2], num_tokens=200)  # same spec as the engines'
        d = SamplingParams(temperature=0.0, max_tokens=8,
                           extra_args={"kv_transfer_params": ticket.to_vllm()})
        mon = cluster.monitors["DF"]
        failures = mon.snapshot().transfers.failures
        fut = asyncio.run_coroutine_threadsafe(collect(cluster.DF, ids + [5], d, "doomed"),
                                               cluster.loop.loop)
        # The pull is accepted, and the producer stalls (120 s) before its reply.
        wait_until(lambda: fake.cmd(op="finished")["status"]["claimed"] == 1, "the pull")
        # DF's blocks for it are allocated (its stats reach the monitor with its steps).
        wait_until(lambda: mon.snapshot().kv_cache_usage > 0, "DF's blocks in use")
        assert not fut.done()
        fake.proc.kill()
        out = fut.result(timeout=HANG_S)  # a hang guard, not a speed check
        assert out.outputs[0].finish_reason == "error"
        assert mon.snapshot().transfers.failures == failures + 1  # the pull failed
    finally:
        fake.close()
