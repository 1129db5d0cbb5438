"""Which workers serve a request.

Decode: power of two choices — sample two live decode workers, take the one with more free KV
blocks net of what the router already sent it, then fewer running requests. Two random probes
avoid the herd that "always the least loaded" causes when load reports lag behind a burst.
Prefill: the shortest queue (router in-flight + the worker's own queue).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.registry import Worker


def _decode_score(w: Worker) -> tuple[float, int]:
    # Every in-flight request will hold blocks soon even if the last heartbeat predates it.
    per_request = max(w.load.total_kv_blocks // max(w.capacity.max_num_seqs, 1), 1)
    free = w.load.free_kv_blocks - w.inflight * per_request
    return (-free, w.load.running + w.inflight)


def choose_decode(workers: Sequence[Worker], rng: random.Random) -> Worker:
    assert workers, "caller checks for an empty pool"
    if len(workers) == 1:
        return workers[0]
    a, b = rng.sample(list(workers), 2)
    return min((a, b), key=_decode_score)


def choose_prefill(workers: Sequence[Worker]) -> Worker:
    assert workers, "caller checks for an empty pool"
    return min(workers, key=lambda w: (w.inflight + w.load.queue_len, w.load.waiting))
