"""Whole-block gather/scatter between vLLM's paged KV cache and one contiguous staging buffer.

In vLLM 0.32 every attention backend hands the connector one tensor per layer whose logical
shape is [num_blocks, num_kv_heads, block_size, C] — the block dimension is dim 0 on CPU (layout
LBHNC, contiguous) and on GPU (default LBNHC, a strided view) alike. The CPU kernels reinterpret
the inside of a block ([H, N, 2D] as [H, 2N, D]), so we never look inside: whole blocks move as
bytes, and both sides must agree on the layout (spec.py checks it).

Staging layout: [num_layers, num_blocks, H, N, row] of raw words (int64, or bytes when a row is
not a multiple of 8 bytes), sent as a uint8 buffer, so fp8 and bf16 caches travel bit-exact over
backends (gloo) that do not know those dtypes.
"""

from __future__ import annotations

import torch


def _words(layer: torch.Tensor) -> torch.Tensor:
    """The layer as raw machine words, [num_blocks, H, N, C * element_size / word]: index ops
    exist for integer types on every device (not for fp8), a raw copy is bit-exact by
    construction, and 8-byte words copy several times faster than single bytes."""
    row_bytes = layer.shape[-1] * layer.element_size()
    return layer.view(torch.int64 if row_bytes % 8 == 0 else torch.uint8)


def staging_bytes(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> int:
    first = next(iter(kv_caches.values()))
    return len(kv_caches) * num_blocks * first[0].numel() * first.element_size()


def staging_view(raw: torch.Tensor, kv_caches: dict[str, torch.Tensor],
                 num_blocks: int) -> torch.Tensor:
    """View a flat uint8 buffer as [L, num_blocks, H, N, words], matching `_words`."""
    first = _words(next(iter(kv_caches.values())))
    return raw.view(first.dtype).view(len(kv_caches), num_blocks, *first.shape[1:])


def gather(kv_caches: dict[str, torch.Tensor], block_ids: list[int], out: torch.Tensor) -> None:
    """Copy `block_ids` of every layer into `out` (a staging_view)."""
    first = next(iter(kv_caches.values()))
    idx = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for i, layer in enumerate(kv_caches.values()):
        torch.index_select(_words(layer), 0, idx, out=out[i])


def scatter(src: torch.Tensor, kv_caches: dict[str, torch.Tensor], block_ids: list[int]) -> None:
    """Write `src` (a staging_view) into `block_ids` of every layer."""
    first = next(iter(kv_caches.values()))
    idx = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for i, layer in enumerate(kv_caches.values()):
        _words(layer).index_copy_(0, idx, src[i])


def scatter_layer(src: torch.Tensor, layer: torch.Tensor, block_ids: list[int]) -> None:
    """Write one layer's part of a staging view (`src[i]`) into `block_ids` of `layer`."""
    if block_ids:
        idx = torch.tensor(block_ids, dtype=torch.long, device=layer.device)
        _words(layer).index_copy_(0, idx, src)
