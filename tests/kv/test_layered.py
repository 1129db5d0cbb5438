"""Layered in-step loads (layered.py): the order a forward pass may rely on, the forward taking
layers the helper has not reached, and the load through a real producer. The engine's side
(golden output, a slowed helper): test_connector_e2e.py."""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from splitserve.kv import blocks, layered
from splitserve.kv.layered import LayeredScatter
from tests.kv.transport_harness import arena_ready, job

LAYERS, NUM_BLOCKS = 3, 10
IDS = [7, 2, 5]  # the tail (2) in the middle: the others go as two runs


def caches() -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.zeros(NUM_BLOCKS, 2, 4, 8, dtype=torch.bfloat16)
            for i in range(LAYERS)}


def staged(kv: dict[str, torch.Tensor]) -> torch.Tensor:
    return blocks.staging_view(torch.randn(LAYERS * 3 * 2 * 4 * 8, dtype=torch.bfloat16)
                               .view(torch.uint8), kv, 3)


def filled(kv: dict[str, torch.Tensor], layer: int, block: int) -> bool:
    return bool(list(kv.values())[layer][block].any())


def gate_layers(monkeypatch, kv: dict[str, torch.Tensor]) -> list[threading.Semaphore]:
    """blocks.scatter_layer waits for its layer's gate: a permit a run (with the tail block in
    the middle of IDS a layer has two runs, without it one)."""
    index = {t.data_ptr(): i for i, t in enumerate(kv.values())}  # a layer's block view too
    gates = [threading.Semaphore(0) for _ in range(LAYERS)]
    real = blocks.scatter_layer

    def gated(src_layer, layer, idx):
        gates[index[layer.data_ptr()]].acquire()
        real(src_layer, layer, idx)

    monkeypatch.setattr(layered.blocks, "scatter_layer", gated)
    return gates


def exact(kv: dict[str, torch.Tensor], src: torch.Tensor) -> bool:
    want = caches()
    blocks.scatter(src, want, IDS)
    return all(torch.equal(kv[n], want[n]) for n in kv)


def test_the_tail_block_lands_first_and_each_layer_before_its_wait_returns(monkeypatch) -> None:
    """The forward may start once `ready` is set: by then the block it writes itself (the
    tail) is in place in every layer. wait_layer(i) returns only once layer i is complete."""
    kv = caches()
    src, gates = staged(kv), gate_layers(monkeypatch, kv)
    scatter = LayeredScatter(LAYERS, tail_block=2)
    helper = threading.Thread(target=scatter, args=(src, kv, IDS), daemon=True)
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
    assert exact(kv, src)


def test_the_forward_scatters_the_layers_the_helper_has_not_reached(monkeypatch) -> None:
    """A helper held up in layer 0 (as one kept off the cores would be): the forward's wait for
    the last layer scatters layers 1 and 2 itself and returns without waiting for the helper;
    the helper returns (and the producer may be told "read") only once every layer is in."""
    kv = caches()
    src, gates = staged(kv), gate_layers(monkeypatch, kv)
    scatter = LayeredScatter(LAYERS, tail_block=None)
    helper = threading.Thread(target=scatter, args=(src, kv, IDS), daemon=True)
    helper.start()
    assert scatter.ready.wait(10)
    gates[1].release(2)
    gates[2].release(2)
    forward = threading.Thread(target=scatter.wait_layer, args=(LAYERS - 1,), daemon=True)
    forward.start()
    forward.join(10)
    assert not forward.is_alive(), "the forward waited for a helper that never got there"
    assert scatter.stolen == 2
    assert all(filled(kv, i, b) for i in (1, 2) for b in IDS)
    assert not filled(kv, 0, 7)
    helper.join(0.2)
    assert helper.is_alive()  # layer 0 is still the helper's
    gates[0].release(2)
    helper.join(10)
    assert not helper.is_alive() and exact(kv, src)


class LateHelper(LayeredScatter):
    """A helper held up (as one kept off the cores would be) before it claims its first layer,
    until `late` is set; the forward's claims go on."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.late, self.helper = threading.Event(), None

    def _claim(self, upto: int) -> int | None:
        if threading.current_thread() is self.helper:
            self.late.wait()
        return super()._claim(upto)


def test_the_helper_waits_for_the_layers_the_forward_took(monkeypatch) -> None:
    """The forward took layer 0 and is still scattering it: the helper does the rest, then
    waits for layer 0 before it returns (after that the staging buffer may be reused)."""
    kv = caches()
    src, gates = staged(kv), gate_layers(monkeypatch, kv)
    scatter = LateHelper(LAYERS, None)
    late = scatter.late
    helper = scatter.helper = threading.Thread(target=scatter, args=(src, kv, IDS), daemon=True)
    helper.start()
    assert scatter.ready.wait(10)
    forward = threading.Thread(target=scatter.wait_layer, args=(0,), daemon=True)
    forward.start()  # takes layer 0, then waits at its gate
    for _ in range(1000):
        if scatter.stolen:
            break
        forward.join(0.01)
    assert scatter.stolen == 1
    late.set()
    gates[1].release()
    gates[2].release()
    helper.join(2)
    assert helper.is_alive() and not filled(kv, 0, 7)
    assert all(filled(kv, i, b) for i in (1, 2) for b in IDS)
    gates[0].release()
    forward.join(10)
    helper.join(10)
    assert not helper.is_alive() and scatter.stolen == 1 and exact(kv, src)


def test_a_failed_scatter_fails_the_load_and_releases_the_forward(monkeypatch) -> None:
    kv = caches()
    src = staged(kv)

    def broken(src_layer, layer, idx):
        raise RuntimeError("scatter broke")

    monkeypatch.setattr(layered.blocks, "scatter_layer", broken)
    scatter = LayeredScatter(LAYERS, tail_block=None)
    errors = []

    def helper() -> None:
        try:
            scatter(src, kv, IDS)
        except RuntimeError as e:
            errors.append(e)
        finally:
            scatter.finish()

    t = threading.Thread(target=helper, daemon=True)
    t.start()
    assert scatter.ready.wait(10)
    scatter.wait_layer(LAYERS - 1)  # returns: every layer is over, failed or not
    t.join(10)
    assert [str(e) for e in errors] == ["scatter broke"]


def test_finish_releases_every_wait_when_the_load_never_scattered() -> None:
    scatter = LayeredScatter(LAYERS, tail_block=None)
    waiter = threading.Thread(target=scatter.wait_layer, args=(LAYERS - 1,), daemon=True)
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
    scatter, done = c.load_layered(replace(job(p, "t1", [1, 2, 3], [4, 5, 6]), sync=True,
                                           tail_block=6))
    assert scatter.ready.is_set()
    assert done.result(20) is None
    for name, want in p.expected([1, 2, 3]).items():
        assert torch.equal(c.caches[name][[4, 5, 6]].view(torch.uint8), want.view(torch.uint8))
    assert c.stats.total.arena_transfers == 1

    refused, done = c.load_layered(replace(job(p, "never-held", [1], [7]), sync=True))
    assert refused.ready.is_set() and "refused" in (done.result(20) or "")
    assert c.stats.total.failures == 1
