"""The `splitserve` command: one subcommand per job, heavy imports only inside each job."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _make_tiny_model(args: argparse.Namespace) -> int:
    from splitserve.tiny_model import write_model

    out = write_model(args.dir, args.preset, args.seed)
    print(f"wrote the {args.preset} model (seed {args.seed}) to {out}")
    return 0


def _run_local(args: argparse.Namespace) -> int:
    from splitserve.local_generate import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    p.add_argument("--log-level", default="WARNING", help="python logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("make-tiny-model", help="write the embedded default model to DIR")
    m.add_argument("dir")
    m.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=_make_tiny_model)

    g = sub.add_parser("generate-local", help="stream a completion from one in-process vLLM engine")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF model dir, or 'tiny'/'bench' (default tiny)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="bfloat16")
    g.set_defaults(func=_run_local)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # vLLM logs INFO to stdout by default; keep stdout for answers and quiet vLLM unless asked.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", args.log_level.upper())
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # bad user input: one clear line, not a traceback
        print(f"splitserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
