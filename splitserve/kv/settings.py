"""`kv_connector_extra_config`, typed: what both halves of a transfer are configured with.

Kept apart from connector.py (which imports vLLM) so the producer/consumer harnesses and the
worker servers can build it without loading the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from splitserve.settings import setting

HOLD_MODES = ("auto", "copy", "blocks")
TRANSPORTS = ("auto", "pair")
LOADS = ("async", "sync", "layered")
KV_SECRET_ENV = "SPLITSERVE_KV_SECRET"


@dataclass(frozen=True)
class ConnectorSettings:
    """Defaults work for a one-host cluster."""

    host: str = setting("127.0.0.1", "address KV peers use to reach this worker (side channel, "
                        "data plane)")
    # Bulk KV can take another network than the side channel's messages (a second NIC, a
    # faster fabric): the pair channel's rendezvous store and its gloo/NCCL sockets bind here.
    data_host: str | None = setting(
        None, "address of the KV data plane (the pair channel's store and process group) when "
        "bulk KV should take another network than --kv-host; default: --kv-host")
    side_channel_port: int = setting(
        0, "prefill side: the KV side channel's port (0: any free one, which the worker reports)")
    lease_s: float = setting(
        30.0, "prefill side: held KV is freed if nobody pulls (or releases) it within this")
    timeout_s: float = setting(10.0, "every network wait of a KV transfer")
    # Shared secret both sides of the side channel prove (mutual HMAC). Never in vLLM's config:
    # the engine reads it from $SPLITSERVE_KV_SECRET, which its processes inherit (engine.py);
    # the command line takes a file (deploy/security_flags.py), never the value.
    secret: str | None = setting(None, internal=True, repr=False)
    # Each decode engine keeps one connection to each producer, so this caps the decode engines
    # per producer; the bound keeps a flood of connections from costing a thread each.
    max_connections: int = setting(
        64, "prefill side: KV side-channel connections served at once (one thread each); more "
        "are refused")
    # "copy" frees vLLM's blocks at once (on CPU a busy engine costs cores, not memory);
    # "blocks" keeps them until pulled (on a GPU device memory is the scarce thing).
    hold: str = setting(
        "auto", "prefill side: copy held KV blocks out and free them at once (copy), keep "
        "vLLM's blocks until pulled (blocks), or auto: copy on CPU, blocks on GPU",
        choices=HOLD_MODES)
    # A consumer on this host scatters straight out of the arena: one copy fewer on the
    # hand-off's path (shm.HoldArena).
    hold_arena_mib: int = setting(
        256, "prefill side, CPU: shared memory for held KV copies, made when the first decode "
        "worker on this host connects, which then reads them where they lie; 0: private memory")
    transport: str = setting(
        "auto", "auto: KV between workers on one host through shared memory, across hosts over "
        "the pair channel (torch.distributed); pair: always the pair channel (either side can "
        "refuse shared memory)", choices=TRANSPORTS)
    # "sync": the second token one step sooner; the whole batch waits for the pull (a hung
    # producer up to timeout_s once, after which loads from it fail at once for timeout_s: see
    # consumer.py). "layered" shortens the hand-off at low load (docs/benchmarks.md, "KV
    # hand-off"). "async": a slow producer delays nobody else.
    load: str = setting(
        "sync", "decode side: sync pulls in the step that schedules the request (the batch "
        "waits for the pull); layered is sync with the scatter beside the forward pass, a "
        "layer ahead of it (CPU caches; elsewhere sync); async pulls beside the engine's steps "
        "and schedules the request once its KV has landed", choices=LOADS)
    # producer: where to publish transfer counts for the worker server (board.py); None = nowhere
    status_file: str | None = setting(None, internal=True)

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

    @property
    def data_address(self) -> str:
        return self.data_host or self.host

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


