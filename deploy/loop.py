"""The event loop every splitserve server runs on: uvloop where it is installed.

gRPC's asyncio stack costs less CPU per streamed message on uvloop than on the standard loop,
and the router relays a message per token, so the loop is part of its per-token price
(docs/benchmarks.md, "Router overhead"). vLLM's own server runs on uvloop too.
SPLITSERVE_UVLOOP=0 turns it off.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any


def run(main: Coroutine[Any, Any, Any]) -> Any:
    if os.environ.get("SPLITSERVE_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)
