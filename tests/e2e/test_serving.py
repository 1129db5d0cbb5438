"""End to end over gRPC: real router and worker processes, real vLLM engines, CPU + gloo.
The cluster (tests/e2e/conftest.py) is shared with the other e2e modules."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer

from splitserve.v1 import common_pb2, generation_pb2
from tests.e2e.cluster import ProcCluster
from tests.utils import GOLDEN_LENGTHS, make_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leak_check")]
STOP = common_pb2.FINISH_REASON_STOP


def _request(ids: list[int], max_tokens: int = 24, **sampling) -> generation_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **sampling})
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=sp)


def _stream(stub, req, timeout: float = 120.0
            ) -> tuple[list[int], str, generation_pb2.GenerateResponse]:
    ids, text, last = [], "", None
    for chunk in stub.Generate(req, timeout=timeout):
        ids += chunk.token_ids
        text += chunk.text
        last = chunk
    return ids, text, last


def _golden(cl: ProcCluster, router: str, tiny_model_dir: Path, seed: int) -> None:
    prompts = make_prompts(tiny_model_dir, GOLDEN_LENGTHS * 2, seed=seed)  # 32 requests
    ref = cl.generation(cl.by_name["R"])
    want = [_stream(ref, _request(p))[0] for p in prompts]
    stub = cl.generation(cl.by_name[router])
    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: _stream(stub, _request(p)), prompts))
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for n, w, (ids, text, last) in zip(GOLDEN_LENGTHS * 2, want, got):
        assert ids == w, f"{n}-token prompt via {router}: {ids} != colocated {w}"
        assert text == tok.decode(ids, skip_special_tokens=True)
        assert last.usage.prompt_tokens == n and last.usage.completion_tokens == len(ids)
        assert last.HasField("finish_reason") and last.timings.e2e_s >= last.timings.ttft_s > 0


def test_golden_2p2d_32_concurrent_streams(cl, tiny_model_dir: Path) -> None:
    _golden(cl, "A", tiny_model_dir, seed=11)


def test_golden_1p1d_static_workers(cl, tiny_model_dir: Path) -> None:
    _golden(cl, "B", tiny_model_dir, seed=12)


def test_text_prompt_stop_string_and_complete(cl) -> None:
    stub = cl.generation(cl.by_name["A"])
    req = generation_pb2.GenerateRequest(text="The river and the mountain",
                                         sampling=common_pb2.SamplingParams(temperature=0,
                                                                            max_tokens=40))
    full = stub.Complete(req, timeout=60)
    assert full.text and full.usage.completion_tokens == len(full.token_ids)
    stop = full.text[len(full.text) // 2:][:3]  # a string that really occurs mid-output
    req.sampling.stop.append(stop)
    cut = stub.Complete(req, timeout=60)
    assert cut.finish_reason == STOP and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]


def _chunks(stub, req) -> list[list[int]]:
    return [list(c.token_ids) for c in stub.Generate(req, timeout=120) if c.token_ids]


@pytest.mark.parametrize(("router", "alone"), [("R", 1), ("B", 2)])  # colocated, 1P1D
def test_stream_interval_batches_the_same_tokens(cl, tiny_model_dir: Path, router: str,
                                                 alone: int) -> None:
    """The engine holds tokens back until `stream_interval` are ready: the stream comes in fewer
    messages, with the same greedy tokens. `alone`: leading messages the engines send at once
    (the prefill worker's first token, the decode engine's first output). The router may merge
    messages that wait together (a busy host), so sizes are lower bounds."""
    prompt = make_prompts(tiny_model_dir, [200], seed=16)[0]
    stub = cl.generation(cl.by_name[router])
    want = _chunks(stub, _request(prompt, max_tokens=40, ignore_eos=True))
    got = _chunks(stub, _request(prompt, max_tokens=40, ignore_eos=True, stream_interval=5))
    assert sum(got, []) == sum(want, [])
    assert all(len(c) >= 5 for c in got[alone:-1]), [len(c) for c in got]
    assert len(got) <= alone + -(-(40 - alone) // 5)


def test_router_stream_interval_is_every_requests_floor(cl, tiny_model_dir: Path) -> None:
    """Router I runs with --stream-interval 3: a request that asks nothing gets it, one that asks
    for more gets more; both stream what router R (interval 1) streams for the same worker."""
    prompt = make_prompts(tiny_model_dir, [60], seed=17)[0]
    want = sum(_chunks(cl.generation(cl.by_name["R"]), _request(prompt, max_tokens=30)), [])
    stub = cl.generation(cl.by_name["I"])
    for asked, floor in ((None, 3), (1, 3), (6, 6)):
        extra = {} if asked is None else {"stream_interval": asked}
        got = _chunks(stub, _request(prompt, max_tokens=30, **extra))
        assert sum(got, []) == want
        assert all(len(c) >= floor for c in got[1:-1]), (asked, [len(c) for c in got])
        assert len(got) <= 1 + -(-(len(want) - 1) // floor), (asked, [len(c) for c in got])


@pytest.mark.parametrize(("req", "field"), [
    (generation_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4)), "prompt"),
    (generation_pb2.GenerateRequest(text=""), "text"),
    (_request([1, 2], temperature=3.0), "sampling.temperature"),
    (_request([1, 2], top_p=0.0), "sampling.top_p"),
    (_request([1, 2], top_k=-5), "sampling.top_k"),
    (_request([1, 2], max_tokens=0), "sampling.max_tokens"),
    (_request([1, 2], max_tokens=5000), "sampling.max_tokens"),
    (_request([1, 2], stop=[""]), "sampling.stop"),
    (_request([1, 2], stream_interval=0), "sampling.stream_interval"),
    (_request([1, 2], stop=["s" * 30_000]), "sampling.stop"),
    (_request([1, 2], stop_token_ids=[10**7]), "sampling.stop_token_ids"),
    (_request([1, 10**7]), "token_ids"),
    (generation_pb2.GenerateRequest(model="gpt-9", text="hi"), "model"),
])
def test_bad_input_is_invalid_argument(cl, req, field: str) -> None:
    stub = cl.generation(cl.by_name["A"])
    with pytest.raises(grpc.RpcError) as e:
        _stream(stub, req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    ids, _, _ = _stream(stub, _request([1, 2, 3], max_tokens=4))  # still serving
    assert len(ids) >= 1


def test_overload_is_resource_exhausted_and_admitted_complete(cl, tiny_model_dir: Path) -> None:
    prompts = make_prompts(tiny_model_dir, [50] * 6, seed=15)
    stub = cl.generation(cl.by_name["O"])

    def one(ids):
        try:
            return _stream(stub, _request(ids, max_tokens=200, ignore_eos=True))[0]
        except grpc.RpcError as e:
            return e.code()

    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, prompts))
    rejected = [r for r in results if r == grpc.StatusCode.RESOURCE_EXHAUSTED]
    done = [r for r in results if isinstance(r, list)]
    assert rejected and done and len(rejected) + len(done) == 6
    assert all(len(r) == 200 for r in done)


def test_no_worker_is_unavailable(cl) -> None:
    with pytest.raises(grpc.RpcError) as e:
        _stream(cl.generation(cl.by_name["E"]), _request([1, 2, 3]), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_every_engine_holds_the_kv_blocks_the_memory_plan_predicts(cl,
                                                                   tiny_model_dir: Path) -> None:
    from bench.kv_memory import MIB, ModelKvShape, plan

    # The cluster's workers: float32, --kv-cache-mib 128, block size 128 (tests/e2e/cluster.py).
    want = plan(ModelKvShape.from_model_dir(tiny_model_dir), "float32", 128 * MIB).blocks
    got = {p.name: cl.worker_stats(p).load.total_kv_blocks for p in cl.procs if p.role}
    assert got and set(got.values()) == {want}, f"plan says {want} blocks, engines report {got}"


def test_every_engine_core_runs_below_its_servers(cl) -> None:
    """Each worker lowers its vLLM EngineCore (which spins while its runner computes) below the
    servers' priority once the engine is up (splitserve/engine_core.py)."""
    import os

    from splitserve.engine_core import ENGINE_CORE_NICE, engine_cores

    workers = [p for p in cl.procs if p.role]
    cores = {p.name: engine_cores([p.popen.pid]) for p in workers}
    assert workers and all(len(c) == 1 for c in cores.values()), cores
    got = {name: os.getpriority(os.PRIO_PROCESS, pid) for name, (pid,) in cores.items()}
    assert set(got.values()) == {ENGINE_CORE_NICE}, got
    assert {os.getpriority(os.PRIO_PROCESS, p.popen.pid) for p in workers} == {0}


def test_shared_prefixes_are_neither_prefilled_nor_pulled_twice(cl) -> None:
    """Groups of prompts sharing two KV blocks (256 tokens) and differing after them, sent one
    by one through router A (P0, P1, D0, D1). Each group's prompts must go to the prefill worker
    the policy names for the prefix, which then finds both blocks cached for every prompt after
    the group's first; and to one decode worker, which then pulls only the partial third block.
    Routing that ignores prefixes sends a group's prompts to workers without them: fewer hits on
    the right prefill worker, and whole prompts pulled again."""
    import random

    from bench.kv_memory import MIB, ModelKvShape, plan
    from router.policy import home_of, prefix_key

    per_home, per_group, shared, n = 2, 4, 256, 300
    prefill = [cl.by_name[name] for name in ("P0", "P1")]
    decode = [cl.by_name[name] for name in ("D0", "D1")]
    ids = {cl.worker_stats(p).engine_id: p.name for p in prefill}  # worker ids: random per run
    # Two prefixes for each prefill worker, as the policy homes them.
    rng, heads = random.Random(31), {p.name: [] for p in prefill}
    while any(len(h) < per_home for h in heads.values()):
        head = [rng.randrange(3, 1000) for _ in range(shared)]
        home = ids[home_of(prefix_key(head, 128), list(ids))]
        if len(heads[home]) < per_home:
            heads[home].append(head)
    prompts = [[head + [rng.randrange(3, 1000) for _ in range(n - shared)]
                for _ in range(per_group)] for hs in heads.values() for head in hs]
    groups = len(prompts)

    def totals() -> dict[str, tuple[int, int]]:
        return {p.name: (s.prefix_cache_hits, s.kv_pulled_bytes)
                for p in prefill + decode for s in [cl.worker_stats(p)]}

    before = totals()
    stub = cl.generation(cl.by_name["A"])
    for g in range(per_group):  # interleaved: every group's prompt k before any's k + 1
        for group in prompts:
            ids_out, _, last = _stream(stub, _request(group[g], max_tokens=4))
            assert len(ids_out) == 4
    after = totals()
    for p in prefill:
        hits = after[p.name][0] - before[p.name][0]
        assert hits == per_home * (per_group - 1) * shared, (
            f"{p.name}: {hits} prefix-cache hit tokens; its {per_home} prefixes should give "
            f"{per_home * (per_group - 1) * shared}")
    block = plan(ModelKvShape.from_model_dir(Path(cl.model)), "float32", 128 * MIB).block_bytes
    pulled = sum(after[d.name][1] - before[d.name][1] for d in decode)
    # Per group: 3 blocks the first time, then only the third (partial) block.
    assert pulled == groups * (3 + (per_group - 1)) * block, f"{pulled / block:.1f} blocks"
