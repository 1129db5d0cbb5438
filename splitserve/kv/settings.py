"""`kv_connector_extra_config`, typed: what both halves of a transfer are configured with.

Kept apart from connector.py (which imports vLLM) so the producer/consumer harnesses and the
worker servers can build it without loading the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

HOLD_MODES = ("auto", "copy", "blocks")
TRANSPORTS = ("auto", "pair")
LOADS = ("async", "sync", "layered")
KV_SECRET_ENV = "SPLITSERVE_KV_SECRET"


@dataclass(frozen=True)
class ConnectorSettings:
    """Defaults work for a one-host cluster."""

    host: str = "127.0.0.1"  # address peers use to reach this worker (side channel, gloo)
    side_channel_port: int = 0  # producer: 0 = any free port (the worker reports the real one)
    lease_s: float = 30.0  # producer: held KV is freed if nobody pulls (or releases) within this
    timeout_s: float = 10.0  # every network wait of a transfer
    # Shared secret both sides of the side channel prove (mutual HMAC). Never in vLLM's config:
    # the engine reads it from $SPLITSERVE_KV_SECRET, which its processes inherit (engine.py).
    secret: str | None = field(default=None, repr=False)
    # producer: side-channel connections served at once (one thread each); more are refused.
    # Each decode engine keeps one to each producer, so this caps the decode engines per
    # producer; the bound keeps a flood of connections from costing a thread each.
    max_connections: int = 64
    # producer: "copy" copies held blocks out and frees them at once, "blocks" keeps vLLM's
    # blocks until pulled, "auto" = copy on CPU (a busy engine costs cores there), blocks on GPU
    # (device memory is the scarce thing there).
    hold: str = "auto"
    # producer: MiB of shared memory for copy-out holds, made when the first consumer on this
    # host connects; such a consumer scatters straight out of it, saving the producer's copy
    # on the hand-off's path (shm.HoldArena). 0 = none: held copies stay in private memory.
    hold_arena_mib: int = 256
    # "auto": through shared memory when both ends see the same /dev/shm (one host; CPU caches),
    # else the pair channel; "pair": always the pair channel. Either side can refuse shm.
    transport: str = "auto"
    # consumer: "sync" pulls in the engine step that first schedules the request, before its
    # forward pass (the second token one step sooner; the whole batch waits for the pull, a hung
    # producer up to timeout_s once, after which loads from it fail at once for timeout_s: see
    # consumer.py); "layered" is "sync" with the scatter running beside the forward pass, a
    # layer ahead of it, instead of before it (CPU caches; elsewhere it is "sync"; layered.py);
    # "async" pulls beside the engine's steps and schedules the request once the KV has landed
    # (a step or two later; a slow producer delays nobody else). docs/benchmarks.md, "KV
    # hand-off", has the measurements behind the default: "layered" shortens the hand-off at
    # low load; it cost TPOT under load on a Xeon before the forward took the layers its helper
    # had not reached, and has not been rechecked there since (on an AMD EPYC: no cost).
    load: str = "sync"
    # producer: where to publish transfer counts for the worker server (board.py); None = nowhere
    status_file: str | None = None

    def __post_init__(self) -> None:
        if self.hold not in HOLD_MODES:
            raise ValueError(f"hold must be one of {HOLD_MODES}, got {self.hold!r}")
        if self.load not in LOADS:
            raise ValueError(f"load must be one of {LOADS}, got {self.load!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.lease_s <= 0 or self.timeout_s <= 0:
            raise ValueError("lease_s and timeout_s must be positive")
        if self.hold_arena_mib < 0:
            raise ValueError(f"hold_arena_mib must be >= 0, got {self.hold_arena_mib}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        unknown = set(extra) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys: {sorted(unknown)}")
        if extra.get("secret") is None and os.environ.get(KV_SECRET_ENV):
            extra = {**extra, "secret": os.environ[KV_SECRET_ENV]}
        return cls(**extra)

    def to_extra(self) -> dict[str, Any]:
        """kv_connector_extra_config for vLLM: everything but the secret (vLLM logs its
        config; the secret reaches the engine through its environment instead)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "secret" and getattr(self, f.name) is not None}

    def shares_memory(self, device_type: str) -> bool:
        """Whether this side offers (consumer) or accepts (producer) the shared-memory path."""
        from splitserve.kv import shm

        return self.transport == "auto" and device_type == "cpu" and shm.available()

    def copies_out(self, device_type: str) -> bool:
        """Whether a producer on `device_type` copies held blocks out (see `hold`)."""
        return self.hold == "copy" or (self.hold == "auto" and device_type == "cpu")


# The defaults once, for the command lines that expose them (deploy/cli.py, deploy/ray/cli.py).
KV_DEFAULTS = ConnectorSettings()
