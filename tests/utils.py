"""Helpers shared by tests: exact-length prompts and greedy generation on a real vLLM engine."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from tokenizers import Tokenizer

from splitserve.engine import token_prompt
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
