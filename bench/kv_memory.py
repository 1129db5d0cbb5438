"""`splitserve plan --memory MODEL`: what a worker's KV cache holds, from a model's config alone.

The explainer's worked example as a command: KV bytes per token are
layers x KV heads x head size x 2 (K and V) x bytes per element, so grouped-query attention (few
KV heads) and an fp8 cache show up directly in the figure. From the bytes a worker gives its KV
cache follow the blocks, the longest context one sequence can reach, and how many sequences of a
given context fit at once. vLLM sizes its cache the same way (blocks = KV bytes // (block size x
bytes per token), every layer's block allocated together), which tests/test_smollm2.py and the
e2e cluster check against the engine's own reported block count.

KV bytes are either given (`--kv-cache-mib`, what splitserve's workers are configured with, on
CPU and GPU alike) or derived for a GPU: device memory x memory fraction - weights - a reserve for
activations that the config cannot tell (vLLM measures it with a profiling run; say it with
`--reserve-gib`).
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from splitserve.models import resolve_model, stored_dtype

# Bytes per element of the model dtypes and of vLLM's kv_cache_dtype values.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                      "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class ModelKvShape:
    """What of a Hugging Face config.json decides the size of its KV cache."""

    layers: int
    kv_heads: int
    head_dim: int
    max_position: int
    stored_dtype: str | None
    parameters: int | None  # counted from the safetensors headers, when there are any

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelKvShape:
        d = Path(model_dir)
        try:
            cfg = json.loads((d / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{d}: no readable config.json ({e})") from None
        cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
        try:
            heads = int(cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
            return cls(layers=int(cfg["num_hidden_layers"]),
                       kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
                       max_position=int(cfg.get("max_position_embeddings") or 0),
                       stored_dtype=stored_dtype(str(d)),
                       parameters=_count_parameters(d))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{d}/config.json lacks an attention shape: {e}") from None

    def bytes_per_token(self, element_bytes: int) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * element_bytes

    def weight_bytes(self, dtype: str) -> int | None:
        return None if self.parameters is None else self.parameters * element_bytes(dtype)


def _count_parameters(d: Path) -> int | None:
    """Parameters in the directory's safetensors files, from their headers (no weights read)."""
    files = sorted(d.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                total += math.prod(t["shape"])
    return total


@dataclass(frozen=True)
class MemoryPlan:
    model_dtype: str
    kv_dtype: str
    bytes_per_token: int
    block_size: int
    kv_bytes: int
    blocks: int
    longest_context: int  # one sequence alone: the cache's tokens, capped by the model's window
    context: int
    sequences_at_context: int
    weight_bytes: int | None

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size


def element_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}") from None


def plan(shape: ModelKvShape, model_dtype: str, kv_bytes: int, *, kv_dtype: str = "auto",
         block_size: int = 128, context: int | None = None) -> MemoryPlan:
    """`kv_dtype` "auto" is the model's dtype, as in vLLM. `context` defaults to the model's
    window (or the longest context, if that is shorter)."""
    kv_dtype = model_dtype if kv_dtype == "auto" else kv_dtype
    per_token = shape.bytes_per_token(element_bytes(kv_dtype))
    blocks = max(kv_bytes, 0) // (per_token * block_size)
    longest = blocks * block_size
    if shape.max_position:
        longest = min(longest, shape.max_position)
    ctx = context or longest
    seqs = blocks // math.ceil(ctx / block_size) if ctx > 0 else 0
    return MemoryPlan(model_dtype=model_dtype, kv_dtype=kv_dtype, bytes_per_token=per_token,
                      block_size=block_size, kv_bytes=kv_bytes, blocks=blocks,
                      longest_context=longest, context=ctx, sequences_at_context=seqs,
                      weight_bytes=shape.weight_bytes(model_dtype))


def model_dtype_for(dtype: str, model_dir: str, shape: ModelKvShape,
                    gpu: bool) -> tuple[str, str]:
    """The dtype the workers will run, and why: as splitserve/engine.py `concrete_dtype` decides
    on this host (CPU), or for a GPU host (the checkpoint's own dtype)."""
    if dtype != "auto":
        return dtype, "as given"
    if gpu:
        stored = shape.stored_dtype if shape.stored_dtype in DTYPE_BYTES else "bfloat16"
        return stored, "a GPU runs the checkpoint's dtype"
    from splitserve.engine import concrete_dtype

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return concrete_dtype("auto", cpuinfo=cpuinfo, model_dir=model_dir)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory (with --memory MODEL)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model's dtype), fp8, fp8_e4m3, fp8_e5m2")
    g.add_argument("--dtype", default="auto", help="the workers' model dtype (default: as "
                   "`splitserve up` picks it on this host, or the checkpoint's with --device-"
                   "memory-gib)")
    g.add_argument("--block-size", type=int, default=128, help="tokens per KV block (CPU: 128; "
                   "vLLM on GPU: 16)")
    g.add_argument("--kv-cache-mib", type=int, default=None,
                   help="KV cache per worker (the workers' own flag; default 256)")
    g.add_argument("--device-memory-gib", type=float, default=None,
                   help="a GPU's memory: KV = this x --memory-fraction - weights - --reserve-gib")
    g.add_argument("--memory-fraction", type=float, default=0.9)
    g.add_argument("--reserve-gib", type=float, default=0.0,
                   help="activations and runtime beside the weights (vLLM profiles them)")
    g.add_argument("--context", type=int, default=None,
                   help="tokens per sequence for the concurrency figure (default: the model's "
                        "window)")


def run(a: argparse.Namespace) -> int:
    try:
        model_dir = resolve_model(a.memory)
        shape = ModelKvShape.from_model_dir(model_dir)
        gpu = a.device_memory_gib is not None
        dtype, why = model_dtype_for(a.dtype, model_dir, shape, gpu)
        if gpu and a.kv_cache_mib is not None:
            raise ValueError("give --kv-cache-mib or --device-memory-gib, not both")
        weights = shape.weight_bytes(dtype)
        if gpu:
            if weights is None:
                raise ValueError("no safetensors files to size the weights from: give "
                                 "--kv-cache-mib instead")
            kv = int(a.device_memory_gib * a.memory_fraction * GIB - weights
                     - a.reserve_gib * GIB)
        else:
            kv = (a.kv_cache_mib or 256) * MIB
        if a.block_size <= 0 or (a.context is not None and a.context <= 0):
            raise ValueError("--block-size and --context must be positive")
        p = plan(shape, dtype, kv, kv_dtype=a.kv_cache_dtype, block_size=a.block_size,
                 context=a.context)
    except ValueError as e:
        print(f"splitserve plan: {e}", file=sys.stderr)
        return 2
    print(_render(shape, p, why, gpu))
    return 0


def _render(s: ModelKvShape, p: MemoryPlan, why: str, gpu: bool) -> str:
    kv_el = element_bytes(p.kv_dtype)
    lines = [
        f"model: {s.layers} layers, {s.kv_heads} KV heads x head size {s.head_dim}, window "
        f"{s.max_position or '?'} tokens; runs in {p.model_dtype} ({why})",
        f"KV bytes per token: {s.layers} x {s.kv_heads} x {s.head_dim} x 2 (K, V) x {kv_el} "
        f"({p.kv_dtype}) = {p.bytes_per_token:,} B ({p.bytes_per_token / 1024:.1f} KiB)",
        f"KV block: {p.block_size} tokens = {p.block_bytes / MIB:.3g} MiB",
    ]
    if p.weight_bytes is not None:
        lines.append(f"weights: {s.parameters:,} parameters = {p.weight_bytes / GIB:.3g} GiB "
                     f"in {p.model_dtype}")
    src = "device memory x fraction - weights - reserve" if gpu else "--kv-cache-mib"
    lines += [
        f"KV cache: {p.kv_bytes / MIB:,.0f} MiB ({src}) = {p.blocks:,} blocks = "
        f"{p.blocks * p.block_size:,} tokens",
        f"longest context of one sequence: {p.longest_context:,} tokens",
        f"sequences at {p.context:,} tokens of context at once: {p.sequences_at_context:,}",
    ]
    if p.blocks == 0:
        lines.append("no KV block fits: the engine will refuse to start")
    return "\n".join(lines)
