"""Helpers shared by tests: exact-length prompts and greedy generation on a real vLLM engine."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from tokenizers import Tokenizer

from splitserve.tiny_tokenizer import synth_corpus

# Around and across the 128-token CPU block size, plus the extremes.
GOLDEN_LENGTHS = [1, 2, 5, 17, 127, 128, 129, 200, 255, 256, 257, 384, 511, 640, 1000, 1023]


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
        async for out in engine.generate({"prompt_token_ids": ids}, params, request_id=f"g{i}"):
            final = out
        return list(final.outputs[0].token_ids)

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
