"""The transfer contract: "the KV of request R is held on producer P; pull it or release it".

A `KVTicket` is issued by the prefill engine's connector when a request finishes its prompt
(`request_finished`), travels to the router in the PrefillResponse, from the router to the decode
worker in the DecodeRequest (or back to the prefill worker in a Release), and is what the decode
engine's connector pulls with. It is the only spelling of those fields: converters to and from
the proto (`KvTicket`, the gRPC edge) and vLLM's `kv_transfer_params` dict (the engine edge) live
here, and nowhere else reads their keys.

Torch-free, so the router and the worker servers can use it without loading the engine.
"""

from __future__ import annotations

import hashlib
import hmac
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any, NewType

from splitserve.v1 import common_pb2

# Chosen by the router, once per prefill attempt; unique across the cluster (it embeds a uuid).
TransferId = NewType("TransferId", str)

# Keys of vLLM's kv_transfer_params dict. vLLM carries the dict opaquely between our connector's
# halves and the API process; the "do_remote_*" flags tell our connector which side it is on.
PRODUCE = "do_remote_decode"  # prefill request: hold the KV for a decode worker
CONSUME = "do_remote_prefill"  # decode request: pull the KV named by the ticket
_TICKET = "ticket"
_TRANSFER_ID = "transfer_id"  # prefill request: the router-chosen id


@dataclass(frozen=True, slots=True)
class KVTicket:
    transfer_id: TransferId  # names the transfer on every component and in every log line
    engine_id: str  # the producing engine; the consumer's handshake refuses any other
    host: str  # producer side channel
    port: int
    block_ids: tuple[int, ...]  # in the producer's cache, prompt order; last may be partial
    num_tokens: int  # prompt tokens whose KV the blocks hold
    lease_expires_at: float  # unix time; the producer frees the KV unsent after it
    spec_fingerprint: str  # KVSpec.fingerprint() of the producer's cache
    # The router's HMAC over the fields above (vouch): proof that a router checked this ticket
    # names the prefill worker it called. Empty until vouched.
    voucher: str = ""

    def __post_init__(self) -> None:
        # A decode worker can be called directly, so a ticket is user input until proven sane.
        problems = []
        if not self.transfer_id:
            problems.append("transfer_id is empty")
        if not self.host:
            problems.append("host is empty")
        if not 0 < self.port < 65536:
            problems.append(f"port {self.port} is not a TCP port")
        if not self.block_ids or min(self.block_ids) < 0:
            problems.append("block_ids must be non-empty and non-negative")
        if self.num_tokens <= 0:
            problems.append(f"num_tokens must be positive, got {self.num_tokens}")
        if problems:
            raise ValueError("ticket: " + "; ".join(problems))

    def seconds_left(self, now: float | None = None) -> float:
        """Lease time left by this host's clock (a hint: the producer's clock decides)."""
        return self.lease_expires_at - (time.time() if now is None else now)

    # -- vouching (docs/security.md) ----------------------------------------------------------
    def _mac(self, key: bytes) -> str:
        # Fields in a fixed order, one a line; repr() of the float is exact and stable.
        text = "\n".join([self.transfer_id, self.engine_id, self.host, str(self.port),
                          ",".join(map(str, self.block_ids)), str(self.num_tokens),
                          repr(float(self.lease_expires_at)), self.spec_fingerprint])
        return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()

    def vouch(self, key: bytes) -> KVTicket:
        return replace(self, voucher=self._mac(key))

    def vouched_by(self, key: bytes) -> bool:
        return hmac.compare_digest(self.voucher.encode(), self._mac(key).encode())

    # -- gRPC edge --------------------------------------------------------------------------
    def to_proto(self) -> common_pb2.KvTicket:
        return common_pb2.KvTicket(**asdict(self))

    @classmethod
    def from_proto(cls, m: common_pb2.KvTicket) -> KVTicket:
        return cls(TransferId(m.transfer_id), m.engine_id, m.host, m.port, tuple(m.block_ids),
                   m.num_tokens, m.lease_expires_at, m.spec_fingerprint, m.voucher)

    # -- vLLM edge --------------------------------------------------------------------------
    def to_vllm(self) -> dict[str, Any]:
        """kv_transfer_params for the decode request (and what the producer returns)."""
        d = asdict(self)
        d["block_ids"] = list(self.block_ids)
        return {CONSUME: True, _TICKET: d}

    @classmethod
    def from_vllm(cls, params: dict[str, Any]) -> KVTicket:
        d = dict(params[_TICKET])
        d["block_ids"] = tuple(int(b) for b in d["block_ids"])
        return cls(**d)


def produce_params(transfer_id: TransferId) -> dict[str, Any]:
    """kv_transfer_params for a prefill request whose KV a decode worker will pull."""
    return {PRODUCE: True, _TRANSFER_ID: transfer_id}


def produced_transfer_id(params: dict[str, Any]) -> TransferId:
    """The router-chosen id of a prefill request (`transfer_id_or_new` when it has none)."""
    return transfer_id_or_new(params.get(_TRANSFER_ID))


def transfer_id_or_new(given: object) -> TransferId:
    """The id the caller chose, or a fresh one for a caller that chose none (the router always
    chooses: it is how it releases KV it will not pull)."""
    return TransferId(str(given)) if given else TransferId(uuid.uuid4().hex)
