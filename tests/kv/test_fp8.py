"""An fp8 KV cache across the split (vLLM's CPU backend, separate engine processes, real gloo).

Engines: P8 (producer), D8 (consumer) and C8 (colocated), all `kv_cache_dtype="fp8"`, and C32,
the plain float32 reference. fp8 is lossy against float32 (bench/kv_dtype.py reports how often
greedy outputs still agree), but exact across the split: the decode engine attends over the very
bytes the colocated fp8 engine writes for itself, so its greedy output must be equal.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.kv_memory import MIB, ModelKvShape, plan
from splitserve.engine import EngineConfig
from splitserve.kv.settings import ConnectorSettings
from tests.utils import EAGER, GOLDEN_LENGTHS, EngineSet, disagg_greedy, engine_greedy, make_prompts

pytestmark = pytest.mark.slow
MAX_TOKENS = 16
KV_MIB = 64


@pytest.fixture(scope="module")
def fp8(tiny_model_dir: Path):
    base = {"model": str(tiny_model_dir), "dtype": "float32", "kv_cache_mib": KV_MIB, **EAGER}
    engines = EngineSet({
        "P8": EngineConfig(**base, kv_cache_dtype="fp8", kv_role="kv_producer", engine_id="P8"),
        # The pair channel, as between hosts (the default would take shared memory here): the
        # golden run over torch.distributed with a real engine on both ends.
        "D8": EngineConfig(**base, kv_cache_dtype="fp8", kv_role="kv_consumer", engine_id="D8",
                           kv_settings=ConnectorSettings(transport="pair")),
        "C8": EngineConfig(**base, kv_cache_dtype="fp8"),
        "C32": EngineConfig(**base),
    })
    yield engines
    engines.close()


@pytest.fixture(autouse=True)
def no_leaks(fp8: EngineSet):
    yield
    fp8.assert_idle()


def test_fp8_disaggregated_equals_fp8_colocated(fp8: EngineSet, tiny_model_dir: Path) -> None:
    prompts = make_prompts(tiny_model_dir, GOLDEN_LENGTHS, seed=21)
    want = fp8.run(engine_greedy(fp8["C8"], prompts, MAX_TOKENS))

    async def all_disagg():
        return await asyncio.gather(*(
            disagg_greedy(fp8["P8"], fp8["D8"], ids, MAX_TOKENS, f"f8-{i}")
            for i, ids in enumerate(prompts)))

    before = fp8.monitors["D8"].snapshot().transfers.transfers
    got = fp8.run(all_disagg())
    for n, w, (g, _) in zip(GOLDEN_LENGTHS, want, got):
        assert g == w, f"{n}-token prompt: fp8 disaggregated {g} != fp8 colocated {w}"
    after = fp8.monitors["D8"].snapshot().transfers
    assert after.transfers - before == len(GOLDEN_LENGTHS) and after.failures == 0
    assert after.shm_transfers == 0  # every byte over gloo


def test_fp8_moves_and_holds_a_quarter_of_float32s_bytes(fp8: EngineSet,
                                                          tiny_model_dir: Path) -> None:
    shape = ModelKvShape.from_model_dir(tiny_model_dir)
    (ids,) = make_prompts(tiny_model_dir, [300], seed=22)  # 3 blocks of 128
    mon = fp8.monitors["D8"]
    b0 = mon.snapshot().transfers.bytes
    fp8.run(disagg_greedy(fp8["P8"], fp8["D8"], ids, MAX_TOKENS, "f8-bytes"))
    moved = mon.snapshot().transfers.bytes - b0
    assert moved == 3 * plan(shape, "float32", 0, kv_dtype="fp8").block_bytes
    assert moved * 4 == 3 * plan(shape, "float32", 0).block_bytes
    # The same MiB hold four times the blocks, and `splitserve plan --memory` says how many.
    blocks = {n: e.vllm_config.cache_config.num_gpu_blocks for n, e in fp8.engines.items()}
    assert blocks["C8"] == 4 * blocks["C32"]
    assert blocks["C8"] == plan(shape, "float32", KV_MIB * MIB, kv_dtype="fp8").blocks
