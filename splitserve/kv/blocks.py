"""Whole-block gather/scatter between vLLM's paged KV cache and one contiguous staging buffer.

In vLLM 0.32 every attention backend hands the connector one tensor per layer whose logical
shape is [num_blocks, num_kv_heads, block_size, C] — the block dimension is dim 0 on CPU (layout
LBHNC, contiguous) and on GPU (default LBNHC, a strided view) alike. The CPU kernels reinterpret
the inside of a block ([H, N, 2D] as [H, 2N, D]), so we never look inside: whole blocks move as
bytes, and both sides must agree on the layout (spec.py checks it).

Staging layout: [num_layers, num_blocks, H, N, C * element_size] of raw bytes, so fp8 and bf16
caches travel bit-exact over backends (gloo) that do not know those dtypes.
"""

from __future__ import annotations

import torch


def _bytes(layer: torch.Tensor) -> torch.Tensor:
    """The layer as raw bytes, [num_blocks, H, N, C * element_size]: index ops exist for uint8
    on every device, not for fp8, and a byte copy is bit-exact by construction."""
    return layer.view(torch.uint8)


def staging_bytes(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> int:
    first = next(iter(kv_caches.values()))
    return len(kv_caches) * num_blocks * first[0].numel() * first.element_size()


def staging_view(raw: torch.Tensor, kv_caches: dict[str, torch.Tensor],
                 num_blocks: int) -> torch.Tensor:
    """View a flat uint8 buffer as [L, num_blocks, H, N, C * element_size]."""
    first = _bytes(next(iter(kv_caches.values())))
    return raw.view(len(kv_caches), num_blocks, *first.shape[1:])


def gather(kv_caches: dict[str, torch.Tensor], block_ids: list[int], out: torch.Tensor) -> None:
    """Copy `block_ids` of every layer into `out` (a staging_view)."""
    first = next(iter(kv_caches.values()))
    idx = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for i, layer in enumerate(kv_caches.values()):
        torch.index_select(_bytes(layer), 0, idx, out=out[i])


def scatter(src: torch.Tensor, kv_caches: dict[str, torch.Tensor], block_ids: list[int]) -> None:
    """Write `src` (a staging_view) into `block_ids` of every layer."""
    first = next(iter(kv_caches.values()))
    idx = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for i, layer in enumerate(kv_caches.values()):
        _bytes(layer).index_copy_(0, idx, src[i])
