"""Release of held KV from the prefill worker's server, through the engine instead of the network.

The prefill worker's gRPC server (API process) must release held KV when the router asks; the
producer lives in the engine's worker process. vLLM's `collective_rpc` runs a method of the
worker there, between engine steps, and `worker_extension_cls` adds ours to its class: no socket,
no credential, nothing anyone outside the process can call. (Each call wakes the worker, which
then busy-polls for a second on CPU hosts, so it is for rare events only; counts are read from
the producer's board instead, board.py.)

API side: `await kv_release(engine, transfer_id)`; `await kv_endpoint(engine)` once at start-up
(the side channel's address, which the worker registers so the router can vouch for its tickets).
"""

from __future__ import annotations

from typing import Any

EXTENSION = "splitserve.kv.control.KVControl"  # EngineConfig sets worker_extension_cls to this


class KVControl:
    """Mixed into vLLM's worker class (runs in the worker process)."""

    def splitserve_kv_release(self, transfer_id: str) -> str:
        producer = _producer()
        return producer.release(transfer_id) if producer is not None else "unknown"

    def splitserve_kv_endpoint(self) -> str:
        producer = _producer()
        return f"{producer.settings.host}:{producer.side_port}" if producer is not None else ""

    def splitserve_aot_loads(self) -> int:
        """Compiled forwards this worker loaded from vLLM's AOT compile cache: whether a later
        start read the cache (splitserve/compilation.py) rather than compiling again."""
        from splitserve.compilation import aot_loads

        return aot_loads()


def _producer():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return getattr(get_kv_transfer_group(), "producer", None) if has_kv_transfer_group() else None


async def kv_release(engine: Any, transfer_id: str) -> str:
    """Release `transfer_id`; returns its state before ("unknown" if never held)."""
    states = await engine.collective_rpc("splitserve_kv_release", args=(transfer_id,))
    known = [s for s in states if s != "unknown"]
    return known[0] if known else "unknown"


async def kv_endpoint(engine: Any) -> str:
    """host:port of the engine's KV side channel ("" when it has no producer)."""
    return next((a for a in await engine.collective_rpc("splitserve_kv_endpoint") if a), "")
