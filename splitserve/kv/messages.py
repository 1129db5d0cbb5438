"""The side channel's messages: typed, versioned records, spelled once for both ends.

A connection's life in messages (consumer → producer unless marked ←):
  ← Challenge        the producer's nonce and engine id, first thing on a new connection
                     (or ← Refusal: it is serving its limit of connections)
    Hello            the consumer's proof, nonce, KV spec and the transports it offers
  ← Welcome          the transport the producer chose, its parameters and the producer's proof
                     (or ← Refusal: incompatible cache, wrong secret, malformed hello)
  then any number of
    Pull → ← Pulled  "the bytes of blocks X of transfer T"; the transport's own fields ride in
                     `move` both ways (or ← Refusal: unknown, expired, released transfer)
    Landed           after a Pulled whose bytes the consumer read where the producer keeps
                     them: the producer may let go of them now
    Release → ← Released   "I will not pull T"
On the wire each is a JSON object with "op" (its kind) and "v" (VERSION) beside its fields;
`encode`/`decode` are the only places that spelling exists, and `decode` checks every field's
type, so the ends never read a dict a peer filled in.
"""

from __future__ import annotations

import socket
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from splitserve.kv.wire import WireError, recv_msg, send_msg

VERSION = 1


@dataclass(frozen=True, slots=True)
class Challenge:
    engine_id: str
    challenge: str  # the producer's nonce, which the consumer's proof covers


@dataclass(frozen=True, slots=True)
class Hello:
    engine_id: str
    link_key: str  # names this connection's link (a pair channel's group, the proofs)
    expect_engine_id: str | None  # the ticket's producer: refused when someone else answers
    spec: dict  # KVSpec.to_dict(): the producer refuses a cache that differs
    challenge: str  # the consumer's nonce, which the producer's proof covers
    proof: str  # "" when no secret is configured
    offers: dict  # transport key -> what the producer needs to take it (transport/)


@dataclass(frozen=True, slots=True)
class Welcome:
    transport: str  # the path the producer chose among the offers
    params: dict  # what the consumer needs to use it; the proof covers both
    proof: str


@dataclass(frozen=True, slots=True)
class Refusal:
    error: str  # for the consumer's log and its load's error


@dataclass(frozen=True, slots=True)
class Pull:
    transfer_id: str
    block_ids: list  # the producer's block ids, in the consumer's order
    move: dict = field(default_factory=dict)  # the transport's fields (ConsumerEnd.request)


@dataclass(frozen=True, slots=True)
class Pulled:
    nbytes: int  # the staging bytes of the pull: the consumer checks them against its own
    move: dict = field(default_factory=dict)  # the transport's fields (Staged.reply)


@dataclass(frozen=True, slots=True)
class Landed:
    transfer_id: str


@dataclass(frozen=True, slots=True)
class Release:
    transfer_id: str


@dataclass(frozen=True, slots=True)
class Released:
    state: str  # the transfer's state before the release, or "unknown"


Message = Challenge | Hello | Welcome | Refusal | Pull | Pulled | Landed | Release | Released
_KINDS: dict[str, type] = {cls.__name__.lower(): cls for cls in Message.__args__}
_TYPES = {"str": str, "int": int, "dict": dict, "list": list, "str | None": (str, type(None))}
M = TypeVar("M")


def encode(msg: Message) -> dict[str, Any]:
    return {"op": type(msg).__name__.lower(), "v": VERSION,
            **{f.name: getattr(msg, f.name) for f in fields(msg)}}


def decode(raw: dict[str, Any]) -> Message:
    """The record `raw` spells; WireError naming what is wrong when it spells none."""
    if raw.get("v") != VERSION:
        raise WireError(f"peer speaks side-channel version {raw.get('v')!r}, we speak {VERSION}")
    cls = _KINDS.get(raw.get("op"))  # type: ignore[arg-type]
    if cls is None:
        raise WireError(f"unknown side-channel message {raw.get('op')!r}")
    values = {}
    for f in fields(cls):
        if f.name not in raw:
            if f.default_factory is not MISSING:
                continue
            raise WireError(f"{cls.__name__} without {f.name}")
        value = raw[f.name]
        if not isinstance(value, _TYPES[f.type]) or isinstance(value, bool) and f.type == "int":
            raise WireError(f"{cls.__name__}.{f.name} is not a {f.type}: {value!r}")
        values[f.name] = value
    if cls is Pull and not all(isinstance(b, int) for b in values["block_ids"]):
        raise WireError(f"Pull.block_ids are not block ids: {values['block_ids']!r}")
    return cls(**values)


def send(sock: socket.socket, msg: Message) -> None:
    send_msg(sock, encode(msg))


def recv(sock: socket.socket, *want: type[M]) -> M:
    """The next message, which must be one of `want` (WireError otherwise)."""
    msg = decode(recv_msg(sock))
    if not isinstance(msg, want):
        raise WireError(f"expected {' or '.join(w.__name__ for w in want)}, got {msg}")
    return msg  # type: ignore[return-value]
