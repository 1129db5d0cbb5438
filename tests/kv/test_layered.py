"""Layered in-step loads (layered.py): the order a forward pass may rely on, and the load through
a real producer. The engine's side (golden output, a slowed helper): test_connector_e2e.py."""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from splitserve.kv import blocks, layered
from splitserve.kv.layered import LayeredScatter
from tests.kv.transport_harness import arena_ready, job

LAYERS, NUM_BLOCKS = 3, 10


def caches() -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.zeros(NUM_BLOCKS, 2, 4, 8, dtype=torch.bfloat16)
            for i in range(LAYERS)}


def filled(kv: dict[str, torch.Tensor], layer: int, block: int) -> bool:
    return bool(list(kv.values())[layer][block].any())


def test_the_tail_block_lands_first_and_each_layer_before_its_wait_returns(monkeypatch) -> None:
    """The forward may start once `ready` is set: by then the block it writes itself (the
    tail) is in place in every layer. wait_layer(i) returns only once layer i is complete."""
    kv = caches()
    src = blocks.staging_view(torch.randn(LAYERS * 3 * 2 * 4 * 8, dtype=torch.bfloat16)
                              .view(torch.uint8), kv, 3)
    ids = [7, 2, 5]  # the tail in the middle: the others go as two runs
    gates = [threading.Semaphore(0) for _ in range(LAYERS)]
    calls = iter(range(2 * LAYERS))  # two runs per layer
    real = blocks.scatter_layer

    def gated(src_layer, layer, block_ids):
        gates[next(calls) // 2].acquire()
        real(src_layer, layer, block_ids)

    monkeypatch.setattr(layered.blocks, "scatter_layer", gated)
    scatter = LayeredScatter(LAYERS, tail_block=2)
    helper = threading.Thread(target=scatter, args=(src, kv, ids))
    helper.start()
    assert scatter.ready.wait(10)
    assert all(filled(kv, i, 2) for i in range(LAYERS))
    assert not any(filled(kv, i, b) for i in range(LAYERS) for b in (7, 5))
    for i in range(LAYERS):
        gates[i].release(2)
        scatter.wait_layer(i)
        assert filled(kv, i, 7) and filled(kv, i, 5)
        assert not any(filled(kv, j, 7) for j in range(i + 1, LAYERS))
    helper.join(10)
    want = caches()
    blocks.scatter(src, want, ids)
    assert all(torch.equal(kv[n], want[n]) for n in kv)


def test_finish_releases_every_wait_when_the_load_never_scattered() -> None:
    scatter = LayeredScatter(LAYERS, tail_block=None)
    waiter = threading.Thread(target=scatter.wait_layer, args=(LAYERS - 1,))
    waiter.start()
    scatter.finish()  # the pull failed before any byte arrived
    waiter.join(10)
    assert not waiter.is_alive() and scatter.ready.is_set()


def test_a_layered_load_through_the_hold_arena(producers, consumers) -> None:
    """The consumer's layered load: back once the forward may start, the bytes exact once the
    future is done; a refused pull still sets `ready`, and its future carries the error."""
    p, c = producers(copy_out=True), consumers("auto")
    arena_ready(p, c)
    p.cmd(op="hold", transfer_id="t1", block_ids=[1, 2, 3])
    scatter = LayeredScatter(len(c.caches), tail_block=6)
    done = c.load_layered(replace(job(p, "t1", [1, 2, 3], [4, 5, 6]), sync=True, tail_block=6),
                          scatter)
    assert scatter.ready.is_set()
    assert done.result(20) is None
    for name, want in p.expected([1, 2, 3]).items():
        assert torch.equal(c.caches[name][[4, 5, 6]].view(torch.uint8), want.view(torch.uint8))
    assert c.stats.total.arena_transfers == 1

    refused = LayeredScatter(len(c.caches), tail_block=None)
    done = c.load_layered(replace(job(p, "never-held", [1], [7]), sync=True), refused)
    assert refused.ready.is_set() and "refused" in (done.result(20) or "")
    assert c.stats.total.failures == 1
