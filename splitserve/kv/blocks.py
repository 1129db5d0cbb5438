"""Whole-block gather/scatter between vLLM's paged KV cache and one contiguous staging buffer.

In vLLM 0.32 every attention backend hands the connector one tensor per layer whose logical
shape is [num_blocks, num_kv_heads, block_size, C] — the block dimension is dim 0 on CPU (layout
LBHNC, contiguous) and on GPU (default LBNHC, a strided view) alike. The CPU kernels reinterpret
the inside of a block ([H, N, 2D] as [H, 2N, D]), so we never look inside: whole blocks move as
bytes, and both sides must agree on the layout (spec.py checks it).

Staging layout: [num_layers, num_blocks, H, N, C] in the cache dtype, sent as raw bytes so fp8
and bf16 caches travel bit-exact over backends that do not know those dtypes.
"""

from __future__ import annotations

import torch


def staging_numel(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> int:
    first = next(iter(kv_caches.values()))
    return len(kv_caches) * num_blocks * first[0].numel()


def staging_view(raw: torch.Tensor, kv_caches: dict[str, torch.Tensor],
                 num_blocks: int) -> torch.Tensor:
    """View a uint8 buffer as [L, num_blocks, H, N, C] of the cache dtype."""
    first = next(iter(kv_caches.values()))
    return raw.view(first.dtype).view(len(kv_caches), num_blocks, *first.shape[1:])


def staging_bytes(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> int:
    first = next(iter(kv_caches.values()))
    return staging_numel(kv_caches, num_blocks) * first.element_size()


def gather(kv_caches: dict[str, torch.Tensor], block_ids: list[int], out: torch.Tensor) -> None:
    """Copy `block_ids` of every layer into `out` ([L, n, H, N, C])."""
    first = next(iter(kv_caches.values()))
    idx = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for i, layer in enumerate(kv_caches.values()):
        torch.index_select(layer, 0, idx, out=out[i])


def scatter(src: torch.Tensor, kv_caches: dict[str, torch.Tensor], block_ids: list[int]) -> None:
    """Write `src` ([L, n, H, N, C]) into `block_ids` of every layer."""
    first = next(iter(kv_caches.values()))
    idx = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for i, layer in enumerate(kv_caches.values()):
        layer.index_copy_(0, idx, src[i])
