"""First golden test: vLLM (CPU) greedy output equals Hugging Face transformers' greedy output.

Both run the generated tiny model in float32, where exact token equality is the right
expectation; a divergence is a bug until logprobs show a genuine tie.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from splitserve.engine import EngineConfig, running_engine
from tests.utils import EAGER, engine_greedy, make_prompts

LENGTHS = [1, 3, 17, 100, 127, 128, 129, 300, 700]
MAX_TOKENS = 24

pytestmark = pytest.mark.slow


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:  # one at a time: no padding to differ from vLLM
            x = torch.tensor([ids])
            y = model.generate(x, max_new_tokens=max_tokens, do_sample=False,
                               attention_mask=torch.ones_like(x))
            outs.append(y[0, len(ids):].tolist())
    return outs


def test_vllm_greedy_equals_transformers(tiny_model_dir: Path) -> None:
    prompts = make_prompts(tiny_model_dir, LENGTHS)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)

    async def run() -> list[list[int]]:
        cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", **EAGER)
        with running_engine(cfg) as engine:
            return await engine_greedy(engine, prompts, MAX_TOKENS)

    got = asyncio.run(run())
    for n, want, have in zip(LENGTHS, expected, got):
        assert have == want, f"prompt of {n} tokens: vLLM {have} != transformers {want}"
    # The model must not be degenerate: different prompts give different continuations.
    assert len({tuple(g) for g in got}) > len(got) // 2
