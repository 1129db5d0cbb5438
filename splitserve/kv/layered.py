"""An in-step load whose scatter overlaps the forward pass that reads it (`load="layered"`).

An in-step load ("sync") makes the decode engine's forward pass wait for the whole scatter of
the pulled KV into the request's blocks: ~4 ms for 16 MB on a CPU host, on the hand-off's path.
The forward reads layer i's cache only in layer i's attention, and vLLM asks the connector for
each layer first (`wait_for_layer_load`), so the scatter can run beside the forward, a layer
ahead of it, on a helper thread.

One block cannot wait: the one holding the first slot this step writes. The request's first new
token (the prefill's first token) lands in the last, partial block of the prompt, and on CPU the
new token's K/V are written before the layer's attention, and before its wait. Scattered after
that write, the producer's copy of the block (which has nothing in that slot) would overwrite
it. So that block goes first, for every layer, and only then may the forward start (`ready`).
Full blocks are never written by the step: prefix caching shares only full blocks, and the new
tokens go into the partial block or into fresh ones that are not part of the pull.

Lifecycle: the engine thread starts the load on the helper and waits for `ready` (the pull's
round trip and the tail block); the forward runs, each layer waiting for its own scatter; after
the forward the engine thread joins the helper, which has sent the producer its "read". The
helper always calls `finish`, failed or not, so no wait outlives the load: a load that failed
reports its blocks as not loaded after the forward, as an in-step load always has, and vLLM
discards that step's token for the request and recomputes (or fails it, by policy).

Not the default: under load the helper waits for a core the other engine keeps busy, and the
forward waits for the helper (docs/benchmarks.md, "KV hand-off": TPOT 6.1 -> 8.0 ms on the
tiny model at 5 req/s, where the gap between the first and second token shrank 63 -> 55 ms on
the bench model at low load). Planned: the pull's round trip on the engine's thread, and the
engine's thread scattering the layers the helper has not reached when the forward gets there.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from splitserve.kv import blocks


class LayeredScatter:
    def __init__(self, num_layers: int, tail_block: int | None, stall_s: float = 0.0) -> None:
        self.num_layers = num_layers
        self.tail_block = tail_block  # the local block this step also writes, if pulled
        self.ready = threading.Event()  # the forward may start
        self._done = 0  # layers whose blocks are all in place
        self._cond = threading.Condition()
        self._stall_s = stall_s  # tests: a slow scatter, so that a missing wait shows

    def __call__(self, src: torch.Tensor, kv_caches: dict[str, torch.Tensor],
                 block_ids: list[int]) -> None:
        """`blocks.scatter`, in the order the forward needs it (runs on the helper thread)."""
        n = len(block_ids)
        at = block_ids.index(self.tail_block) if self.tail_block in block_ids else n
        if at < n:
            blocks.scatter(src[:, at:at + 1], kv_caches, [self.tail_block])
        self.ready.set()
        # The other blocks as (at most) two runs of positions: views of the staging buffer,
        # not copies of it (the tail block is normally the last one pulled).
        runs = [(lo, hi) for lo, hi in ((0, at), (at + 1, n)) if lo < hi]
        for i, layer in enumerate(kv_caches.values()):
            if self._stall_s:
                time.sleep(self._stall_s)
            for lo, hi in runs:
                blocks.scatter_layer(src[i, lo:hi], layer, block_ids[lo:hi])
            with self._cond:
                self._done = i + 1
                self._cond.notify_all()

    def finish(self) -> None:
        """The load is over, scattered or failed: nothing may wait for it any more."""
        with self._cond:
            self._done = self.num_layers
            self._cond.notify_all()
        self.ready.set()

    def wait_layer(self, index: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done > index)


def leave_engine_cores() -> None:
    """Move the calling thread off the cores it inherited from the engine's thread (bound to
    the engine's own cores), onto the host's others: beside the forward pass, not under it. A
    thread left on the engine's core would only take turns with the forward. It may land on
    another engine's core: a few milliseconds of copying per hand-off (the same work `sync` does
    on the engine's own core). No-op where the engine holds every core."""
    own = os.sched_getaffinity(0)
    others = set(range(os.cpu_count() or 1)) - own
    if others:
        try:
            os.sched_setaffinity(0, others)  # 0: this thread (Linux keeps affinity per thread)
        except OSError:
            pass  # none of them is ours to use (a cpuset): stay
