"""Exact engine options of the pools: greedy output unchanged, and the option really in effect.

n-gram speculative decoding (decode pool) and chunked prefill at a small chunk (prefill pool).
Engines (tiny model, float32): C plain colocated, the reference (itself held to transformers'
greedy output first); CS colocated with 4
speculative tokens; P a producer; DS a consumer with 4 speculative tokens, so the disaggregated
path runs speculation on KV it pulled; CK colocated with 256-token engine steps, so every
prompt above 256 tokens is prefilled in chunks.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from splitserve.engine import EngineConfig
from tests.utils import (
    EAGER,
    GOLDEN_LENGTHS,
    EngineSet,
    disagg_greedy,
    engine_greedy,
    hf_greedy_ids,
    make_prompts,
)

pytestmark = pytest.mark.slow
MAX_TOKENS = 48
SPEC = 4
CHUNK = 256


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path):
    base = {"model": str(tiny_model_dir), "dtype": "float32", "kv_cache_mib": 64, **EAGER}
    e = EngineSet({
        "C": EngineConfig(**base),
        "CS": EngineConfig(**base, speculative_tokens=SPEC),
        "P": EngineConfig(**base, kv_role="kv_producer", engine_id="SP"),
        "DS": EngineConfig(**base, kv_role="kv_consumer", engine_id="SDS",
                           speculative_tokens=SPEC),
        "CK": EngineConfig(**base, max_num_batched_tokens=CHUNK),
    })
    yield e
    e.close()


@pytest.fixture(autouse=True)
def no_leaks(engines: EngineSet):
    yield
    engines.assert_idle()


def test_vllm_greedy_equals_transformers(engines: EngineSet, tiny_model_dir: Path) -> None:
    """The first golden test: vLLM (CPU) greedy output equals Hugging Face transformers' on the
    tiny model in float32, where exact token equality is the right expectation (a divergence is
    a bug until logprobs show a genuine tie). C is the reference of every golden test here."""
    import torch
    from transformers import AutoModelForCausalLM

    lengths = [1, 3, 17, 100, 127, 128, 129, 300, 700]
    prompts = make_prompts(tiny_model_dir, lengths)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = hf_greedy_ids(model, prompts, 24)
    got = engines.run(engine_greedy(engines["C"], prompts, 24))
    for n, want, have in zip(lengths, expected, got):
        assert have == want, f"prompt of {n} tokens: vLLM {have} != transformers {want}"
    # The model must not be degenerate: different prompts give different continuations.
    assert len({tuple(g) for g in got}) > len(got) // 2


def _prompts(model_dir: Path) -> list[list[int]]:
    # Repetition is where prompt lookup finds drafts: a few prompts repeat their own opening.
    varied = make_prompts(model_dir, GOLDEN_LENGTHS[::2], seed=41)
    looped = [(p * 8)[:600] for p in make_prompts(model_dir, [40, 75], seed=42)]
    return varied + looped


def test_speculative_greedy_equals_plain_colocated_and_drafts_are_accepted(
        engines: EngineSet, tiny_model_dir: Path) -> None:
    e, mon = engines, engines.monitors
    prompts = _prompts(tiny_model_dir)
    want = e.run(engine_greedy(e["C"], prompts, MAX_TOKENS))
    got = e.run(engine_greedy(e["CS"], prompts, MAX_TOKENS))
    for p, w, g in zip(prompts, want, got):
        assert g == w, f"{len(p)}-token prompt: speculative {g} != plain {w}"
    s = mon["CS"].snapshot()
    assert s.spec_draft_tokens > 0 and 0 < s.spec_accepted_tokens <= s.spec_draft_tokens


def test_speculative_decode_worker_on_pulled_kv_equals_plain_colocated(
        engines: EngineSet, tiny_model_dir: Path) -> None:
    e, mon = engines, engines.monitors
    prompts = _prompts(tiny_model_dir)
    want = e.run(engine_greedy(e["C"], prompts, MAX_TOKENS))

    async def all_disagg():
        return await asyncio.gather(*(disagg_greedy(e["P"], e["DS"], ids, MAX_TOKENS, f"s{i}")
                                      for i, ids in enumerate(prompts)))

    before = mon["DS"].snapshot()
    got = e.run(all_disagg())
    for p, w, (g, _) in zip(prompts, want, got):
        assert g == w, f"{len(p)}-token prompt: speculative disaggregated {g} != plain {w}"
    after = mon["DS"].snapshot()
    assert after.transfers.transfers - before.transfers.transfers == len(prompts)
    assert after.spec_accepted_tokens > before.spec_accepted_tokens


def test_chunked_prefill_greedy_equals_one_shot_prefill(engines: EngineSet,
                                                        tiny_model_dir: Path) -> None:
    e = engines
    prompts = make_prompts(tiny_model_dir, [255, 256, 257, 640, 1023, 2000], seed=43)
    want = e.run(engine_greedy(e["C"], prompts, MAX_TOKENS))
    got = e.run(engine_greedy(e["CK"], prompts, MAX_TOKENS))
    for p, w, g in zip(prompts, want, got):
        assert g == w, f"{len(p)}-token prompt: chunked prefill {g} != one-shot {w}"

    fresh = make_prompts(tiny_model_dir, [255, 256, 257, 640, 1023, 2000], seed=44)

    def prefill_steps(name: str) -> int:  # engine steps to prefill them all (one token each)
        before = e.monitors[name].snapshot().steps
        e.run(engine_greedy(e[name], fresh, 1))  # fresh: nothing in the prefix cache
        return e.monitors[name].snapshot().steps - before

    # 4,431 prompt tokens take at least 18 steps of 256; vLLM's default 2,048 needs far fewer.
    minimum = -(-sum(map(len, fresh)) // CHUNK)
    assert prefill_steps("CK") >= minimum > prefill_steps("C")
