"""Helpers shared by tests; prompts and greedy runs on real engines: bench/engines.py."""

from __future__ import annotations

from pathlib import Path

from bench.engines import (  # noqa: F401  (the tests' names for them)
    EngineSet,
    LoopThread,
    collect,
    disagg_greedy,
    engine_greedy,
    make_prompts,
    wait_idle,
)

# Engines in tests start eagerly where start-up dominates what the test proves: compiling the
# tiny model costs a 2-core host 19 s more on its first start there and 4 s more from the compile
# cache, and eager and compiled engines give the same tokens. Compiled engines (the default) run
# where compiling is what is proven: test_connector_e2e's golden cluster, the README's demo.
EAGER = {"enforce_eager": True}
EAGER_FLAG = "--enforce-eager"

# Around and across the 128-token CPU block size, plus the extremes.
GOLDEN_LENGTHS = [1, 2, 5, 17, 127, 128, 129, 200, 255, 256, 257, 384, 511, 640, 1000, 1023]


def chat_prompts(model_dir: Path, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn, rendered with the model's chat template by transformers
    (the reference the router's own rendering is held to in tests/router/test_chat.py)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def hf_greedy_ids(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding), up to and
    including EOS, as vLLM reports it."""
    import torch

    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, max_new_tokens=max_tokens, do_sample=False,
                               attention_mask=torch.ones_like(x))
            outs.append(y[0, len(ids):].tolist())
    return outs
