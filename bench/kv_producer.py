"""A real `Producer` over a plain tensor "KV cache", in its own process, driven over stdin.

The far end of a pair without a vLLM engine: bench/kv_transfer.py measures pulls from it, the
transport tests kill, stall or mismatch it, and the connector tests point a real vLLM consumer at
it. One JSON command per line in, one JSON reply per line out:
  {"op": "hold", "transfer_id": T, "block_ids": [...]}   start a lease (vLLM request id = T)
  {"op": "release", "transfer_id": T}                    → {"state": <state before>}
  {"op": "finished"}   → {"finished": [ids vLLM may free], "status": {...}, "total": {...}}
  {"op": "connections"}  → {"connections": side-channel connections served now, "accepted":
                            connections ever accepted,
                            "threads": the producer's threads (accept loop included),
                            "arena": its hold arena's name or None, "arena_free": its free bytes}
  {"op": "quit"}
The configuration is JSON in argv, except the shared secret: it goes in $SPLITSERVE_KV_SECRET,
as a worker's engine gets it, because a command line is readable by every user of the host;
and a test's faults (a stall mid-transfer, to kill it there), which go in $SPLITSERVE_FAULTS as
they do for an engine (splitserve/faults.py).
`ProducerProc` is the parent's handle on such a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from splitserve.faults import FAULTS_ENV, Faults
from splitserve.kv.producer import Producer
from splitserve.kv.settings import KV_SECRET_ENV, ConnectorSettings
from splitserve.kv.spec import spec_from_caches
from splitserve.kv.stats import TransferStats
from splitserve.kv.ticket import KVTicket, TransferId
from splitserve.kv.transport.arena import ArenaKind

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
          "uint8": torch.uint8}  # vLLM keeps fp8 caches in uint8 tensors
# What a config may say, and its defaults: 3 layers of 16 blocks [2 heads, 32 tokens, 128] bf16.
DEFAULTS: dict[str, Any] = {
    "num_layers": 3, "num_blocks": 16, "shape": [2, 32, 128], "dtype": "bfloat16", "model": "m",
    "block_size": 32, "seed": 7, "engine_id": "fake-p", "port": 0, "copy_out": False,
    "lease_s": 30.0, "timeout_s": 5.0, "secret": None, "data_host": None,
    "max_connections": 64, "cache_dtype": "auto", "transport": "auto",
    "hold_arena_mib": ConnectorSettings().hold_arena_mib}


def make_caches(num_layers: int, num_blocks: int, shape: list[int], dtype: str, seed: int
                ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(num_blocks, *shape, generator=gen).to(DTYPES[dtype])
            for i in range(num_layers)}


def caches_of(cfg: dict[str, Any], seed: int | None = None) -> dict[str, torch.Tensor]:
    return make_caches(cfg["num_layers"], cfg["num_blocks"], cfg["shape"], cfg["dtype"],
                       cfg["seed"] if seed is None else seed)


def settings_of(cfg: dict[str, Any], secret: str | None) -> ConnectorSettings:
    return ConnectorSettings(side_channel_port=cfg["port"], data_host=cfg["data_host"],
                             lease_s=cfg["lease_s"],
                             timeout_s=cfg["timeout_s"], secret=secret,
                             max_connections=cfg["max_connections"],
                             transport=cfg["transport"],
                             hold_arena_mib=cfg["hold_arena_mib"])


def main(cfg: dict[str, Any]) -> None:
    cfg = {**DEFAULTS, **cfg}
    caches = caches_of(cfg)
    spec = spec_from_caches(cfg["model"], cfg["block_size"], caches, cfg["cache_dtype"])
    settings = settings_of(cfg, os.environ.get(KV_SECRET_ENV) or None)
    prod = Producer(cfg["engine_id"], settings, TransferStats(), cfg["copy_out"])
    prod.start(caches, spec)
    print(json.dumps({"ready": True, "port": prod.side_port, "fingerprint": spec.fingerprint()}),
          flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "hold":
            prod.hold(TransferId(cmd["transfer_id"]), cmd["transfer_id"], cmd["block_ids"])
            reply: dict[str, Any] = {"ok": True}
        elif op == "release":
            reply = {"state": prod.release(TransferId(cmd["transfer_id"]))}
        elif op == "connections":
            arena = next((k.arena for k in prod.kinds if isinstance(k, ArenaKind)), None)
            reply = {"connections": prod.connections, "accepted": prod.accepted, "threads": sum(
                t.name.startswith("kv-producer") for t in threading.enumerate()),
                "arena": arena.name if arena else None,
                "arena_free": arena.free_bytes() if arena else 0}
        elif op == "finished":
            reply = {"finished": sorted(prod.take_finished()), "status": prod.status(),
                     "total": prod.stats.total.to_dict()}
        else:
            break
        print(json.dumps(reply), flush=True)
    prod.shutdown()


class ProducerProc:
    """A producer process, started with DEFAULTS updated by `overrides`, and `faults`."""

    def __init__(self, faults: Faults | None = None, **overrides: Any) -> None:
        unknown = set(overrides) - set(DEFAULTS)
        assert not unknown, f"unknown producer settings {unknown}"
        self.cfg = {**DEFAULTS, **overrides}
        public = {k: v for k, v in self.cfg.items() if k != "secret"}
        env = {k: v for k, v in os.environ.items() if k not in (KV_SECRET_ENV, FAULTS_ENV)}
        env.update(faults.to_env() if faults else {})
        if self.cfg["secret"]:
            env[KV_SECRET_ENV] = self.cfg["secret"]
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.kv_producer",
                                      json.dumps(public)], cwd=ROOT, text=True, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        hello = json.loads(self.proc.stdout.readline())
        assert hello["ready"]
        self.port, self.fingerprint = int(hello["port"]), hello["fingerprint"]

    def cmd(self, **msg: Any) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def ticket(self, transfer_id: str, block_ids: list[int], num_tokens: int | None = None,
               lease_s: float = 60.0) -> KVTicket:
        """A ticket naming blocks of this producer (whether or not it holds them)."""
        n = num_tokens or len(block_ids) * self.cfg["block_size"]
        return KVTicket(TransferId(transfer_id), self.cfg["engine_id"], "127.0.0.1", self.port,
                        tuple(block_ids), n, time.time() + lease_s, self.fingerprint)

    def expected(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """The bytes this producer's blocks hold (its caches are a function of the seed)."""
        return {k: v[block_ids] for k, v in caches_of(self.cfg).items()}

    def close(self) -> None:
        """Quit (the producer unlinks its hold arena), or be killed when that does not work."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait(10)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
