"""The event loop every splitserve server runs on: uvloop where it is installed.

gRPC's asyncio stack costs less CPU per streamed message on uvloop than on the standard loop,
and the router relays a message per token, so the loop is part of its per-token price
(docs/benchmarks.md, "Router overhead"). vLLM's own server runs on uvloop too.
`--no-uvloop` (RouterConfig.uvloop, WorkerConfig.uvloop) turns it off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run(main: Coroutine[Any, Any, Any], uvloop: bool = True) -> Any:
    if uvloop:
        try:
            import uvloop as fast
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=fast.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)
