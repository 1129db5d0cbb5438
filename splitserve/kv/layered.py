"""An in-step load whose scatter overlaps the forward pass that reads it (`load="layered"`).

An in-step load ("sync") makes the decode engine's forward pass wait for the whole scatter of
the pulled KV into the request's blocks, on the hand-off's path.
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

Lifecycle: the engine thread starts the load on the helper, a thread on the host's other cores
(`leave_engine_cores`), and waits for `ready` (the pull's round trip and the tail block); then
the helper scatters the layers in order while the forward runs. A layer is scattered by whoever
claims it first: the forward, reaching a layer the helper has not claimed, scatters it itself,
so a helper kept off the cores by other work costs no more than `sync` would. After the forward
the engine thread joins the helper, which waits for every layer (its own and those the forward
took) before it tells the producer "read". The helper always calls `finish`, failed or not, so
no wait outlives the load: a load that failed reports its blocks as not loaded after the
forward, as an in-step load always has, and vLLM discards that step's token for the request and
recomputes (or fails it, by policy).
"""

from __future__ import annotations

import os
import threading

import torch

from splitserve import faults
from splitserve.kv import blocks


class LayeredScatter:
    def __init__(self, num_layers: int, tail_block: int | None,
                 fault: faults.Faults = faults.NONE) -> None:
        self.num_layers = num_layers
        self.tail_block = tail_block  # the local block this step also writes, if pulled
        self.ready = threading.Event()  # the forward may start
        self.stolen = 0  # layers the forward's thread scattered itself
        self._cond = threading.Condition()
        self._next = 0  # the first layer nobody has claimed
        self._done = [False] * num_layers  # layers whose blocks are all in place
        # What a layer's scatter needs, once the bytes are here: the source, the layers, and
        # the blocks as (at most) two runs of positions.
        self._work: tuple[torch.Tensor, list[torch.Tensor],
                          list[tuple[int, int, torch.Tensor]]] | None = None
        self._error: BaseException | None = None
        self._stall_s = fault.layer_stall_s  # a slow helper, so that a missing wait shows

    def __call__(self, src: torch.Tensor, kv_caches: dict[str, torch.Tensor],
                 block_ids: list[int]) -> None:
        """`blocks.scatter`, in the order the forward needs it (runs on the helper thread,
        returns once every layer is in place and nobody reads `src` any more)."""
        n = len(block_ids)
        at = block_ids.index(self.tail_block) if self.tail_block in block_ids else n
        if at < n:
            blocks.scatter(src[:, at:at + 1], kv_caches, [self.tail_block])
        # Views of the staging buffer, not copies of it (the tail block is normally the last);
        # the layers' block views and each run's index made once, not once a layer.
        layers = blocks.layer_blocks(kv_caches)
        runs = [(lo, hi, blocks.block_index(block_ids[lo:hi], src.device))
                for lo, hi in ((0, at), (at + 1, n)) if lo < hi]
        self._work = (src, layers, runs)
        self.ready.set()
        while (i := self._claim(self.num_layers - 1)) is not None:
            faults.Faults.stall(self._stall_s)
            self._scatter(i)
        with self._cond:
            self._cond.wait_for(lambda: all(self._done))  # the forward's own layers too
        self._work = None  # no view of a shared segment outlives the load
        if self._error is not None:
            raise self._error

    def wait_layer(self, index: int) -> None:
        """The forward's thread, before layer `index`'s attention: back once its blocks are in
        place, scattering them (and any layer before it nobody has claimed) itself if need be."""
        while (i := self._claim(index)) is not None:
            self.stolen += 1
            self._scatter(i)
        with self._cond:
            self._cond.wait_for(lambda: self._done[index])

    def finish(self) -> None:
        """The load is over, scattered or failed: nothing may wait for it any more."""
        with self._cond:
            self._next = self.num_layers
            self._done = [True] * self.num_layers
            self._cond.notify_all()
        self.ready.set()

    def _claim(self, upto: int) -> int | None:
        """The next unclaimed layer, if it is at most `upto` and the bytes are here."""
        with self._cond:
            if self._work is None or self._next > upto:
                return None
            self._next += 1
            return self._next - 1

    def _scatter(self, i: int) -> None:
        error = None
        try:
            assert self._work is not None  # cleared only once every layer is done
            src, layers, runs = self._work
            for lo, hi, idx in runs:
                blocks.scatter_layer(src[i, lo:hi], layers[i], idx)
        except BaseException as e:  # raised by the helper: the load fails, nobody waits
            error = e
        with self._cond:
            self._error = self._error or error
            self._done[i] = True
            self._cond.notify_all()


def leave_engine_cores() -> None:
    """Move the calling thread off the cores it inherited from the engine's thread (bound to
    the engine's own cores), onto the host's others: beside the forward pass, not under it. A
    thread left on the engine's core would only take turns with the forward. It may land on
    another engine's core: a few milliseconds of copying per hand-off, or none when the forward
    takes the layers first. No-op where the engine holds every core.

    Not the engine's core for the pull's round trip and aside only for the layers: that made
    every decode step slower, not only the loading ones (docs/benchmarks-log.md, "KV
    hand-off")."""
    own = os.sched_getaffinity(0)
    others = set(range(os.cpu_count() or 1)) - own
    if others:
        try:
            os.sched_setaffinity(0, others)  # 0: this thread (Linux keeps affinity per thread)
        except OSError:
            pass  # none of them is ours to use (a cpuset): stay
