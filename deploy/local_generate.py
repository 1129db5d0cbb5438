"""`splitserve generate-local`: one in-process vLLM engine, streaming text to the terminal.

The smallest end-to-end check of a machine: the default model is generated if needed, the engine
starts (progress goes to stderr), the completion streams to stdout, and the engine shuts down.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_stream(args))


async def _stream(args: argparse.Namespace) -> int:
    from router.text import RouterTokenizer
    from splitserve.engine import EngineConfig, running_engine, token_prompt
    from splitserve.models import resolve_model

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    model = resolve_model(args.model, fetch=True)
    ids = RouterTokenizer(model).encode(args.prompt)  # as the router would send it
    print(f"[splitserve] model {model}; starting a vLLM engine (~15-30 s on CPU) ...",
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with running_engine(EngineConfig(model=model, dtype=args.dtype)) as engine:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        print(f"[splitserve] engine ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed, output_kind=RequestOutputKind.DELTA)
        async for out in engine.generate(token_prompt(ids), params, request_id="local-0"):
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0
