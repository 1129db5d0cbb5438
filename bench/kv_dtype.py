"""An fp8 KV cache against the model's own cache dtype: capacity, transfer, and output agreement.

    python bench/kv_dtype.py [--model tiny] [--dtype float32] [--kv-cache-mib 128]
        [--prompts 32] [--max-tokens 32] [--json FILE]

Per cache dtype (`auto`, i.e. the model's dtype, then `fp8`), one prefill engine and one decode
engine with splitserve's connector, driven in-process by the pull protocol the workers use
(bench/engines.py `disagg_greedy`), the same prompts (lengths spread over 64-2,000 tokens, fresh
text) one at a time, greedy. The pairs run one after the other so each has the host to itself.

Printed per cache dtype: KV blocks in the same MiB, bytes per transfer and per prompt token, mean
transfer time (the decode engine's own measure: pull start to last block scattered); and for fp8,
greedy agreement with the `auto` run: the share of prompts whose outputs are identical, and the
share of output tokens before the first difference. fp8 is lossy, so agreement is a figure to
read, not a pass mark.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from bench.engines import EngineSet, disagg_greedy, make_prompts
from bench.host import machine
from splitserve.engine import EngineConfig, concrete_dtype
from splitserve.models import resolve_model

CACHE_DTYPES = ("auto", "fp8")


def run_pair(model: str, dtype: str, kv_mib: int, cache_dtype: str,
             prompts: list[list[int]], max_tokens: int) -> dict:
    base = {"model": model, "dtype": dtype, "kv_cache_mib": kv_mib, "kv_cache_dtype": cache_dtype}
    e = EngineSet({"P": EngineConfig(**base, kv_role="kv_producer", engine_id=f"P-{cache_dtype}"),
                   "D": EngineConfig(**base, kv_role="kv_consumer", engine_id=f"D-{cache_dtype}")})
    try:
        outputs, t0 = [], time.perf_counter()
        for i, ids in enumerate(prompts):
            outputs.append(e.run(disagg_greedy(e["P"], e["D"], ids, max_tokens,
                                               f"{cache_dtype}-{i}"))[0])
        wall = time.perf_counter() - t0
        t = e.monitors["D"].snapshot().transfers
        return {"cache_dtype": cache_dtype,
                "kv_blocks": e["D"].vllm_config.cache_config.num_gpu_blocks,
                "transfers": t.transfers, "failures": t.failures, "bytes": t.bytes,
                "bytes_per_transfer": t.bytes / max(t.transfers, 1),
                "bytes_per_prompt_token": t.bytes / sum(len(x) for x in prompts),
                "transfer_ms_mean": 1e3 * t.seconds / max(t.transfers, 1),
                "wall_s": wall, "outputs": outputs}
    finally:
        e.close()


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    same = sum(a == b for a, b in zip(ref, got))
    prefix = 0
    for a, b in zip(ref, got):
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"identical_outputs": same / len(ref),
            "tokens_before_first_difference": prefix / sum(len(a) for a in ref)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-mib", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    model = resolve_model(a.model)
    dtype = concrete_dtype(a.dtype, model_dir=model)[0]
    rng = random.Random(a.seed)
    prompts = make_prompts(Path(model), [rng.randint(64, 2000) for _ in range(a.prompts)],
                           seed=a.seed + 1)
    runs = [run_pair(model, dtype, a.kv_cache_mib, c, prompts, a.max_tokens)
            for c in CACHE_DTYPES]
    base, fp8 = runs
    agree = agreement(base["outputs"], fp8["outputs"])
    print(f"model {a.model} ({dtype}), KV {a.kv_cache_mib} MiB, {len(prompts)} prompts, "
          f"{a.max_tokens} tokens each, {machine()['cpu']}")
    print(f"{'cache':<6}{'blocks':>8}{'bytes/transfer':>16}{'B/prompt token':>16}"
          f"{'transfer ms':>13}{'failures':>10}")
    for r in runs:
        print(f"{r['cache_dtype']:<6}{r['kv_blocks']:>8}{r['bytes_per_transfer']:>16,.0f}"
              f"{r['bytes_per_prompt_token']:>16,.0f}{r['transfer_ms_mean']:>13.2f}"
              f"{r['failures']:>10}")
    print(f"fp8 / auto: blocks {fp8['kv_blocks'] / base['kv_blocks']:.2f}x, bytes per transfer "
          f"{fp8['bytes_per_transfer'] / base['bytes_per_transfer']:.2f}x, transfer time "
          f"{fp8['transfer_ms_mean'] / base['transfer_ms_mean']:.2f}x")
    print(f"greedy agreement with auto: {agree['identical_outputs']:.0%} of outputs identical, "
          f"{agree['tokens_before_first_difference']:.0%} of tokens before the first difference")
    if a.json:
        out = {"machine": machine(), "model": a.model, "dtype": dtype,
               "kv_cache_mib": a.kv_cache_mib, "prompts": len(prompts),
               "max_tokens": a.max_tokens, "agreement": agree,
               "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
