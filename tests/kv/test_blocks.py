"""Block copies (blocks.py) in both of vLLM's memory orders, and the one-launch kernel
(block_kernel.py) run on CPU tensors through Triton's interpreter: the same bytes as the copies
by layer, in both directions. Its speed needs a GPU (bench/kv_blocks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from splitserve.kv import block_kernel, blocks

ROOT = Path(__file__).resolve().parents[2]
LAYERS, NUM_BLOCKS, HEADS, TOKENS, C = 3, 9, 2, 16, 16


def caches(strided: bool, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """[blocks, H, N, C] per layer; strided: memory [blocks, N, H, C] (vLLM's GPU order)."""
    out = {}
    for i in range(LAYERS):
        shape = (NUM_BLOCKS, TOKENS, HEADS, C) if strided else (NUM_BLOCKS, HEADS, TOKENS, C)
        t = torch.randint(0, 255, shape, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 \
            else torch.randint(-30000, 30000, shape, dtype=torch.int16).view(dtype)
        out[f"layer.{i}"] = t.permute(0, 2, 1, 3) if strided else t
    return out


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_a_block_travels_as_its_bytes_in_memory_order(strided: bool) -> None:
    kv, ids = caches(strided), [7, 0, 4]
    raw = torch.empty(blocks.staging_bytes(kv, len(ids)), dtype=torch.uint8)
    staging = blocks.staging_view(raw, kv, len(ids))
    blocks.gather(kv, ids, staging)
    for i, layer in enumerate(kv.values()):
        in_memory = layer.permute(0, 2, 1, 3) if strided else layer  # as the bytes lie
        assert torch.equal(staging[i].view(torch.int16),
                           in_memory[ids].reshape(len(ids), -1).view(torch.int16))
    back = {k: torch.zeros_like(v) for k, v in kv.items()}
    blocks.scatter(staging, back, ids)
    for k in kv:
        assert torch.equal(back[k][ids].view(torch.int16), kv[k][ids].view(torch.int16))
        others = [b for b in range(NUM_BLOCKS) if b not in ids]
        assert not back[k][others].view(torch.int16).any()


def test_a_block_that_is_not_one_range_of_memory_is_refused() -> None:
    layer = torch.zeros(4, TOKENS, 2 * HEADS, C, dtype=torch.bfloat16)[:, :, :HEADS]
    with pytest.raises(ValueError, match="not one dense range"):
        blocks.gather({"l": layer.permute(0, 2, 1, 3)}, [0], torch.empty(1, 1, 64,
                                                                          dtype=torch.int64))


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from splitserve.kv import block_kernel, blocks
    from tests.kv.test_blocks import caches

    for strided in (False, True):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            kv, ids = caches(strided, dtype), [5, 1, 8, 2]
            layers = blocks.layer_blocks(kv)
            idx = torch.tensor(ids)
            want = torch.stack([layer[idx] for layer in layers])  # the copies by layer
            staging = torch.zeros_like(want)
            block_kernel.copy(layers, idx, staging, to_staging=True)
            assert torch.equal(staging, want), (strided, dtype, "gather")
            back = {k: torch.zeros_like(v) for k, v in kv.items()}
            block_kernel.copy(blocks.layer_blocks(back), idx, staging, to_staging=False)
            for k in kv:
                assert torch.equal(back[k][ids].view(torch.uint8), kv[k][ids].view(torch.uint8))
                rest = [b for b in range(len(kv[k])) if b not in ids]
                assert not back[k][rest].view(torch.uint8).any(), (strided, dtype, "scatter")
    print("kernel ok")
""")


@pytest.mark.evidence  # the one run of the GPU kernel's code in CI: it must not skip quietly
def test_the_one_launch_kernel_moves_the_same_bytes_as_the_copies_by_layer() -> None:
    # Triton is a test dependency (pyproject.toml); without it this fails rather than skips.
    assert block_kernel.available(), "Triton is not installed (or SPLITSERVE_KV_ONE_LAUNCH=0)"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "kernel ok" in proc.stdout, proc.stderr[-4000:]
