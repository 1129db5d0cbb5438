"""A real `Producer` over a plain tensor "KV cache", in its own process, driven over stdin.

Transport tests use it as the far end of a pair (kill it, stall it, mismatch its spec) without a
vLLM engine; e2e tests use it as a producer a real vLLM consumer pulls from. One JSON command per
line in, one JSON reply per line out.
"""

from __future__ import annotations

import json
import sys

import torch

from splitserve.kv.producer import Producer
from splitserve.kv.spec import spec_from_caches
from splitserve.kv.stats import TransferStats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def make_caches(num_layers: int, num_blocks: int, shape: list[int], dtype: str, seed: int
                ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(num_blocks, *shape, generator=gen).to(DTYPES[dtype])
            for i in range(num_layers)}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    caches = make_caches(cfg["num_layers"], cfg["num_blocks"], cfg["shape"], cfg["dtype"],
                         cfg.get("seed", 0))
    spec = spec_from_caches(cfg["model"], cfg["block_size"], caches)
    prod = Producer(cfg.get("engine_id", "fake-p"), "127.0.0.1", cfg["port"], cfg["lease_s"],
                    cfg["timeout_s"], cfg.get("secret"), TransferStats(),
                    cfg.get("stall_before_send_s", 0.0), cfg.get("copy_out", False))
    prod.start(caches, spec)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "hold":
            prod.hold(cmd["transfer_id"], cmd["block_ids"])
            print(json.dumps({"ok": True}), flush=True)
        elif cmd["op"] == "finished":
            print(json.dumps({"finished": sorted(prod.take_finished()),
                              "held": prod.num_held, "total": prod.stats.total.to_dict()}),
                  flush=True)
        elif cmd["op"] == "quit":
            break
    prod.shutdown()


if __name__ == "__main__":
    main()
