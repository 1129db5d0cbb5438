"""The KV cache description both sides of a transfer must share, checked at handshake.

Blocks travel as opaque bytes (see blocks.py), so anything that changes what the bytes of a block
mean must match exactly: the model, the cache dtype, block size, layout, layer count and shapes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

import torch

# 2: `cache_dtype` joined the spec (fp8 caches are uint8 tensors whatever their format).
# 3: a block travels as its bytes in memory order (it went in the view's logical order, which
#    differs on GPU layouts: blocks.py).
PROTOCOL_VERSION = 3


@dataclass(frozen=True)
class KVSpec:
    model: str  # model name/path as configured; a different model means different KV meaning
    dtype: str  # dtype of the cache tensors (after kv_cache_dtype), e.g. "torch.bfloat16"
    block_size: int
    layout: str  # vLLM KV cache layout name, e.g. "LBHNC"; CPU and GPU defaults differ
    num_layers: int
    num_kv_heads: int
    head_size: int  # last dim of the per-layer view (K and V fused in vLLM 0.32)
    # vLLM's kv_cache_dtype ("auto", "fp8_e4m3", "fp8_e5m2"). vLLM keeps every fp8 cache in uint8
    # tensors, so `dtype` alone cannot tell e4m3 bytes from e5m2 bytes.
    cache_dtype: str = "auto"
    version: int = PROTOCOL_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVSpec:
        names = {f.name for f in fields(cls)}
        missing = names - d.keys()
        if missing:
            raise ValueError(f"peer KV spec lacks {sorted(missing)}")
        return cls(**{k: d[k] for k in names})

    def fingerprint(self) -> str:
        """A short digest of everything that gives the bytes their meaning. Tickets carry it,
        so a consumer can tell a foreign cache before it pulls a byte."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def differences(self, other: KVSpec) -> list[str]:
        """Human-readable mismatches, e.g. ["block_size: ours 128, peer's 64"]."""
        return [
            f"{f.name}: ours {getattr(self, f.name)!r}, peer's {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def physical_layout(t: torch.Tensor) -> str:
    """vLLM-style layout name of a [B, H, N, C] view from its strides, e.g. "LBHNC" (CPU) or
    "LBNHC" (GPU FlashAttention's default): the memory order is what the bytes of a block mean."""
    order = sorted(range(4), key=lambda d: (-t.stride(d), d))
    return "L" + "".join("BHNC"[d] for d in order)


def canonical_cache_dtype(cache_dtype: str) -> str:
    """vLLM's "fp8" is e4m3: one spelling per format, so equal formats compare equal."""
    return "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype


def spec_from_caches(model: str, block_size: int, kv_caches: dict[str, torch.Tensor],
                     cache_dtype: str = "auto") -> KVSpec:
    """Read the spec off the live per-layer tensors: [num_blocks, kv_heads, block_size, C]."""
    first = next(iter(kv_caches.values()))
    layout = physical_layout(first)
    assert first.dim() == 4, f"unexpected KV cache rank {first.dim()} (shape {tuple(first.shape)})"
    assert all(t.shape[1:] == first.shape[1:] and t.dtype == first.dtype
               for t in kv_caches.values()), "layers with different KV shapes are not supported"
    return KVSpec(model=model, dtype=str(first.dtype), block_size=block_size, layout=layout,
                  num_layers=len(kv_caches), num_kv_heads=first.shape[1],
                  head_size=first.shape[3], cache_dtype=canonical_cache_dtype(cache_dtype))
