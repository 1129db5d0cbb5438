"""Whole-block gather/scatter between vLLM's paged KV cache and one contiguous staging buffer.

In vLLM 0.32 every attention backend hands the connector one tensor per layer whose logical
shape is [num_blocks, num_kv_heads, block_size, C] — the block dimension is dim 0 on CPU (layout
LBHNC, contiguous) and on GPU (default LBNHC, a strided view) alike, and in both one block is one
dense range of memory. The CPU kernels reinterpret the inside of a block ([H, N, 2D] as
[H, 2N, D]), so we never look inside: a block moves as its bytes in memory order, and both sides
must agree on the layout (spec.py checks it).

Staging layout: [num_layers, num_blocks, words] — each block's bytes as raw words (int64, or
bytes when a row is not a multiple of 8 bytes), sent as a uint8 buffer, so fp8 and bf16 caches
travel bit-exact over backends (gloo) that do not know those dtypes. On a GPU with Triton the
copies of all layers are one launch (block_kernel.py); elsewhere one index copy per layer.
"""

from __future__ import annotations

import torch

from splitserve.kv import block_kernel


def _words(layer: torch.Tensor) -> torch.Tensor:
    """The layer as raw machine words, [num_blocks, H, N, C * element_size / word]: index ops
    exist for integer types on every device (not for fp8), a raw copy is bit-exact by
    construction, and 8-byte words copy several times faster than single bytes."""
    row_bytes = layer.shape[-1] * layer.element_size()
    return layer.view(torch.int64 if row_bytes % 8 == 0 else torch.uint8)


def _blocks(layer: torch.Tensor) -> torch.Tensor:
    """The layer as [num_blocks, words]: row b is block b's bytes in memory order."""
    w = _words(layer)
    span = 1
    for stride, size in sorted((w.stride(d), w.shape[d]) for d in range(1, w.dim())):
        if size > 1 and stride != span:
            raise ValueError(f"a KV block of shape {tuple(layer.shape[1:])} with strides "
                             f"{layer.stride()[1:]} is not one dense range of memory")
        span *= size
    if w.shape[0] > 1 and w.stride(0) < span:
        raise ValueError(f"KV blocks overlap: {span} words each, {w.stride(0)} apart")
    return w.as_strided((w.shape[0], span), (w.stride(0), 1))


def staging_bytes(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> int:
    first = next(iter(kv_caches.values()))
    return len(kv_caches) * num_blocks * first[0].numel() * first.element_size()


def staging_view(raw: torch.Tensor, kv_caches: dict[str, torch.Tensor],
                 num_blocks: int) -> torch.Tensor:
    """View a flat uint8 buffer as [L, num_blocks, words], matching `_blocks`."""
    first = _words(next(iter(kv_caches.values())))
    return raw.view(first.dtype).view(len(kv_caches), num_blocks, first[0].numel())


def layer_blocks(kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every layer as [num_blocks, words] (what `scatter_layer` writes into)."""
    return [_blocks(t) for t in kv_caches.values()]


def block_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index on the cache's device (what `scatter_layer` takes)."""
    if device.type != "cuda":
        return torch.tensor(block_ids, dtype=torch.long)
    # From pinned memory, without waiting: a copy from pageable memory would make the host
    # wait for the device at every gather (the caching allocator keeps the pinned buffer
    # until the copy has run).
    return torch.tensor(block_ids, dtype=torch.long, pin_memory=True).to(device,
                                                                          non_blocking=True)


def _one_launch(layers: list[torch.Tensor]) -> bool:
    return layers[0].is_cuda and block_kernel.available()


def gather(kv_caches: dict[str, torch.Tensor], block_ids: list[int], out: torch.Tensor) -> None:
    """Copy `block_ids` of every layer into `out` (a staging_view)."""
    layers = layer_blocks(kv_caches)
    idx = block_index(block_ids, layers[0].device)
    if _one_launch(layers):
        block_kernel.copy(layers, idx, out, to_staging=True)
        return
    for i, layer in enumerate(layers):
        torch.index_select(layer, 0, idx, out=out[i])


def scatter(src: torch.Tensor, kv_caches: dict[str, torch.Tensor], block_ids: list[int]) -> None:
    """Write `src` (a staging_view) into `block_ids` of every layer."""
    layers = layer_blocks(kv_caches)
    idx = block_index(block_ids, layers[0].device)
    if _one_launch(layers) and src.is_contiguous():
        block_kernel.copy(layers, idx, src, to_staging=False)
        return
    for i, layer in enumerate(layers):
        layer.index_copy_(0, idx, src[i])


def scatter_layer(src: torch.Tensor, layer: torch.Tensor, idx: torch.Tensor) -> None:
    """Write one layer's part of a staging view (`src[i]`) into blocks `idx` of `layer` (one of
    `layer_blocks`; `idx` from `block_index`, made once for all layers)."""
    layer.index_copy_(0, idx, src)


def gather_held(kv_caches: dict[str, torch.Tensor], raw: torch.Tensor | None, held: list[int],
                want: list[int], snapshot: torch.Tensor | None) -> torch.Tensor:
    """Blocks `want` (a subset of the `held` ones, in the consumer's order) as staging bytes:
    into `raw`, or, when None, the copy-out `snapshot` itself (all of it, in order). Read from
    the snapshot when the hold copied the blocks out, else from the cache."""
    if snapshot is not None and want == held:
        if raw is None:
            return snapshot  # the common case: everything, in order, already contiguous
        raw.copy_(snapshot[:raw.numel()])
        return raw
    assert raw is not None
    out = staging_view(raw, kv_caches, len(want))
    if snapshot is None:
        gather(kv_caches, want, out)
    else:
        where = {b: i for i, b in enumerate(held)}
        snap = staging_view(snapshot, kv_caches, len(held))
        pos = torch.tensor([where[b] for b in want], dtype=torch.long, device=snap.device)
        torch.index_select(snap, 1, pos, out=out)
    return raw
