"""One launch for a request's blocks in every layer (CUDA; Triton).

blocks.py's copies by layer cost a kernel launch per layer, and each a host-to-device copy of the
block ids: a fixed cost per gather that a deep model pays once per layer, a large share of a
plain device copy of the same bytes (docs/benchmarks.md, "GPU block copies"). Here one kernel
moves every layer: a
table of the layers' addresses (made once per cache and kept on the device) and the block ids go
in, and program (layer, block, tile) copies one tile of one block as raw words, so any cache
dtype (fp8 too) moves bit-exact. A block is one dense range of memory in vLLM's layouts
(blocks.py checks that), so a tile is a plain coalesced copy.

Tested on CPU tensors through Triton's interpreter (tests/kv/test_blocks.py); the speed
needs a GPU: bench/kv_blocks.py measures both paths on whatever device is present.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a host without Triton copies layer by layer (blocks.py)
    triton = None

TILE = 1024  # words a program copies: 8 KiB of int64, a block of 16 tokens is 8 tiles


def available() -> bool:
    """Triton is here and the operator has not turned the kernel off (SPLITSERVE_KV_ONE_LAUNCH=0:
    the copies by layer, e.g. to compare them: bench/kv_blocks.py)."""
    return triton is not None and os.environ.get("SPLITSERVE_KV_ONE_LAUNCH", "1") != "0"


@functools.cache
def _kernel():  # made on first use: Triton reads TRITON_INTERPRET when a kernel is made
    @triton.jit
    def copy_blocks(layer_addrs, block_ids, staging, num_ids, block_stride, block_words,
                    TO_STAGING: tl.constexpr, TILE: tl.constexpr):
        layer = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1).to(tl.int64)
        offs = tl.program_id(2).to(tl.int64) * TILE + tl.arange(0, TILE)
        mask = offs < block_words
        base = tl.load(layer_addrs + layer).to(tl.pointer_type(staging.dtype.element_ty))
        block = tl.load(block_ids + j).to(tl.int64)
        cache = base + block * block_stride + offs
        stage = staging + (layer * num_ids + j) * block_words + offs
        if TO_STAGING:
            tl.store(stage, tl.load(cache, mask=mask), mask=mask)
        else:
            tl.store(cache, tl.load(stage, mask=mask), mask=mask)

    return copy_blocks


@functools.lru_cache(maxsize=8)
def _table(addrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The layers' addresses on the device: one copy per cache (a cache never moves)."""
    return torch.tensor(addrs, dtype=torch.int64, device=device)


def copy(layers: list[torch.Tensor], ids: torch.Tensor, staging: torch.Tensor,
         to_staging: bool) -> None:
    """Move blocks `ids` of every layer to (or from) `staging`, in one launch.

    layers: [num_blocks, words] views, one per layer (blocks.layer_blocks), all alike;
    ids: the block ids on the layers' device; staging: [num_layers, len(ids), words], dense."""
    first = layers[0]
    block_stride, words = first.stride(0), first.shape[1]
    assert all(t.stride(0) == block_stride and t.shape[1] == words and t.dtype == first.dtype
               for t in layers), "layers laid out differently"
    assert staging.is_contiguous() and staging.shape == (len(layers), ids.numel(), words)
    table = _table(tuple(t.data_ptr() for t in layers), first.device)
    grid = (len(layers), ids.numel(), triton.cdiv(words, TILE))
    # Triton launches on the calling thread's current device, and a transfer pool's thread
    # starts on device 0: name the cache's (a no-op for the interpreter's CPU tensors).
    with torch.cuda.device(first.device) if first.is_cuda else contextlib.nullcontext():
        _kernel()[grid](table, ids, staging, ids.numel(), block_stride, words,
                        TO_STAGING=to_staging, TILE=TILE)
