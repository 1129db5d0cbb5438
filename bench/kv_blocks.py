"""KV block copies against the copy ceiling: gather/scatter of one request's blocks, per size.

    python bench/kv_blocks.py [--tokens 512,2048,8192] [--device cuda] [--repeats N] [--json F]

What a KV transfer costs on each side besides the wire: the producer gathers a request's blocks
out of vLLM's paged cache (one tensor per layer) into one contiguous staging buffer, and the
consumer scatters them back into its own blocks (splitserve/kv/blocks.py). The ceiling is a
plain device copy of the same bytes (`dst.copy_(src)`, one contiguous buffer to another).

The cache is shaped like Llama-3-8B's (32 layers, 8 KV heads, head size 128), bf16, in the
memory order vLLM uses on the device: LBHNC (contiguous) on CPU with 128-token blocks, LBNHC
(a strided view, FlashAttention's default) on GPU with 16-token blocks. A request's blocks are
a random choice among twice as many, so the copies see scattered block ids as in a busy engine.
Every gather and scatter is checked bit-exact once before it is timed. On a GPU with Triton
each size is measured both ways (`path`): the one-launch kernel that is the default there
(splitserve/kv/block_kernel.py) and the copies by layer; elsewhere by layer only.

Columns, GB/s = bytes / seconds / 1e9, each the median of `repeats` timed copies:
  copy_gbps     the plain device copy of the request's bytes (the ceiling)
  gather_gbps   blocks.gather: cache -> staging
  scatter_gbps  blocks.scatter: staging -> cache
  gather_vs_copy, scatter_vs_copy  the ratios (the goal of "make disaggregation pay": >= 0.8
                                   at >= 2,048 prompt tokens on an H200-class GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.host import machine
from splitserve.kv import block_kernel, blocks

LAYERS, KV_HEADS, HEAD_SIZE = 32, 8, 128
COLUMNS = ("copy_gbps", "gather_gbps", "scatter_gbps", "gather_vs_copy", "scatter_vs_copy")


def caches(num_blocks: int, block_size: int, device: torch.device, strided: bool,
           dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """One [num_blocks, H, N, 2*D] tensor per layer, in vLLM's memory order for the device."""
    out = {}
    for i in range(LAYERS):
        if strided:  # memory [blocks, N, H, 2D], seen as [blocks, H, N, 2D]
            t = torch.empty(num_blocks, block_size, KV_HEADS, 2 * HEAD_SIZE, dtype=dtype,
                            device=device).permute(0, 2, 1, 3)
        else:
            t = torch.empty(num_blocks, KV_HEADS, block_size, 2 * HEAD_SIZE, dtype=dtype,
                            device=device)
        t.view(torch.int16).random_(-30000, 30000)  # any bits: the copies move raw words
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of one call, after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_order(layer: torch.Tensor) -> torch.Tensor:
    """The layer with its dimensions in memory order (a block's bytes as they lie)."""
    return layer.permute(*sorted(range(layer.dim()), key=lambda d: -layer.stride(d)))


def measure(tokens: int, device: torch.device, repeats: int, strided: bool,
            seed: int = 0) -> dict[str, float]:
    block_size = 16 if strided else 128
    n = -(-tokens // block_size)
    kv = caches(2 * n, block_size, device, strided)
    ids = random.Random(seed).sample(range(2 * n), n)
    nbytes = blocks.staging_bytes(kv, n)
    raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
    staging = blocks.staging_view(raw, kv, n)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)

    blocks.gather(kv, ids, staging)  # bit-exact check: every layer's blocks, in order
    for i, layer in enumerate(kv.values()):  # as integers: random bits include NaNs
        assert torch.equal(staging[i].view(torch.int16).reshape(n, -1),
                           memory_order(layer)[ids].view(torch.int16).reshape(n, -1)), \
            "gather not bit-exact"
    back = {k: torch.zeros_like(v) for k, v in kv.items()}
    blocks.scatter(staging, back, ids)
    for k in kv:
        assert torch.equal(back[k][ids].view(torch.int16), kv[k][ids].view(torch.int16)), \
            "scatter is not bit-exact"
    del back

    copy_s = timed(lambda: flat.copy_(raw), device, repeats)
    gather_s = timed(lambda: blocks.gather(kv, ids, staging), device, repeats)
    scatter_s = timed(lambda: blocks.scatter(staging, kv, ids), device, repeats)
    row = {"tokens": tokens, "blocks": n, "mib": nbytes / 2**20,
           "copy_gbps": nbytes / copy_s / 1e9, "gather_gbps": nbytes / gather_s / 1e9,
           "scatter_gbps": nbytes / scatter_s / 1e9}
    row["gather_vs_copy"] = row["gather_gbps"] / row["copy_gbps"]
    row["scatter_vs_copy"] = row["scatter_gbps"] / row["copy_gbps"]
    return row


def table(rows: list[dict]) -> str:
    lines = [f"{'path':>10} {'tokens':>7} {'MiB':>8}" + "".join(f"{c:>17}" for c in COLUMNS)]
    lines += [f"{r['path']:>10} {r['tokens']:>7} {r['mib']:>8.1f}"
              + "".join(f"{r[c]:>17.2f}" for c in COLUMNS) for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,2048,8192", help="prompt tokens per request")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--layout", choices=["auto", "contiguous", "strided"], default="auto",
                    help="the cache's memory order: auto is vLLM's for the device (strided with "
                         "16-token blocks on GPU, contiguous with 128-token blocks on CPU)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    if not tokens or min(tokens) <= 0 or a.repeats <= 0:
        ap.error("--tokens and --repeats must be positive")
    device = torch.device(a.device)
    strided = a.layout == "strided" or (a.layout == "auto" and device.type == "cuda")
    # On a GPU with Triton, every size both ways: the one-launch kernel (the default there)
    # and the copies by layer it replaced (block_kernel.py).
    paths = ["one launch", "by layer"] if device.type == "cuda" and block_kernel.available() \
        else ["by layer"]
    rows = []
    for path in paths:
        os.environ["SPLITSERVE_KV_ONE_LAUNCH"] = "1" if path == "one launch" else "0"
        rows += [{"path": path, **measure(t, device, a.repeats, strided)} for t in tokens]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()["cpu"]
    print(f"{where}; {LAYERS} layers x {KV_HEADS} KV heads x head {HEAD_SIZE}, bf16, "
          f"{'strided (LBNHC)' if strided else 'contiguous (LBHNC)'}; GB/s = 1e9 B/s")
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "device": where, "strided": strided,
                                      "machine": machine(),
                                      "torch": torch.__version__, "repeats": a.repeats},
                                     indent=2) + "\n")


if __name__ == "__main__":
    main()
