"""Worker roles: the one spelling of "prefill", "decode" and "colocated" everywhere.

`Role` values are the CLI subcommand names and metric labels; `to_proto` / `from_proto` convert at
the registry's gRPC edge. Torch-free: the router uses it too.
"""

from __future__ import annotations

import enum

from splitserve.v1 import registry_pb2


class Role(enum.StrEnum):
    PREFILL = "prefill"  # runs prompts to their first token and holds their KV for a decode worker
    DECODE = "decode"  # pulls KV from a prefill worker (or prefills itself) and streams tokens
    COLOCATED = "colocated"  # a plain engine: prefills and decodes locally (serves DecodeWorker)

    @property
    def kv_role(self) -> str | None:
        """The vLLM KV-connector role of an engine in this worker role."""
        return {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}.get(self)

    @property
    def decodes(self) -> bool:
        """Serves the DecodeWorker service (streams tokens)."""
        return self is not Role.PREFILL

    def to_proto(self) -> int:
        return _TO_PROTO[self]

    @classmethod
    def from_proto(cls, value: int) -> Role:
        try:
            return _FROM_PROTO[value]
        except KeyError:
            raise ValueError(f"unknown worker role {value}") from None


_TO_PROTO = {Role.PREFILL: registry_pb2.ROLE_PREFILL, Role.DECODE: registry_pb2.ROLE_DECODE,
             Role.COLOCATED: registry_pb2.ROLE_COLOCATED}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}
