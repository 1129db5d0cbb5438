"""The side channel's handshake: mutual proof of the shared secret, the KV spec check, and the
choice of transport, before either side reveals anything or touches the other's memory.

    producer ── Challenge(its nonce) ──► consumer
    producer ◄── Hello(proof, nonce, spec, offers) ── consumer
    producer ── Welcome(transport, params, proof) or Refusal ──► consumer

Each proof names its side and covers both nonces plus what that side's message commits to (the
consumer's link key; the producer's chosen transport and its parameters), so a proof cannot be
reflected back at its sender, replayed on another connection, or kept while a man in the middle
swaps the rest (wire.py). The consumer checks the producer's proof before it goes near the
store or memory the welcome names: a peer without the secret could otherwise pose as a producer
and feed us bytes.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.kv import messages as m
from splitserve.kv.spec import KVSpec
from splitserve.kv.transport import ConsumerEnd, Offer, ProducerEnd, TransportError
from splitserve.kv.wire import CONSUMER, PRODUCER, auth_proof, check_proof, no_delay

log = logging.getLogger(__name__)


class IncompatiblePeer(TransportError):
    """The handshake failed: the producer refused us (different model/dtype/layout, bad secret)
    or could not prove the shared secret itself."""


@dataclass
class Connection:
    """The consumer's side-channel socket to one producer, and the path its bytes take."""

    sock: socket.socket
    end: ConsumerEnd
    offer: str  # the key of the offer the producer took

    def close(self) -> None:
        self.end.close()
        self.sock.close()


def _bound(transport: str, params: dict) -> str:
    """What the producer's proof commits to: its choice, as the consumer reads it."""
    return json.dumps([transport, params], sort_keys=True, separators=(",", ":"))


def _proof(secret: str | None, side: str, producer_nonce: str, consumer_nonce: str,
           bound: str) -> str:
    return auth_proof(secret, side, producer_nonce, consumer_nonce, bound) if secret else ""


def connect(host: str, port: int, *, engine_id: str, expect_engine_id: str | None, spec: KVSpec,
            secret: str | None, timeout_s: float,
            make_offers: Callable[[], list[Offer]]) -> Connection:
    """The consumer's side: a proven, compatible connection to the producer at host:port, over
    the path it chose among the offers (made once the producer answers; the others are closed,
    and all of them on failure)."""
    try:
        sock = no_delay(socket.create_connection((host, port), timeout=timeout_s))
    except OSError as e:
        raise TransportError(f"cannot reach KV producer at {host}:{port}: {e}") from e
    offers: list[Offer] = []
    taken = None
    try:
        offers = make_offers()
        first = m.recv(sock, m.Challenge, m.Refusal)
        if isinstance(first, m.Refusal):
            raise IncompatiblePeer(f"KV producer at {host}:{port} refused: {first.error}")
        ours = secrets.token_hex(16)
        link_key = f"{first.engine_id}/{engine_id}/{uuid.uuid4().hex}"
        m.send(sock, m.Hello(engine_id, link_key, expect_engine_id or None, spec.to_dict(), ours,
                             _proof(secret, CONSUMER, first.challenge, ours, link_key),
                             {o.key: o.params for o in offers}))
        reply = m.recv(sock, m.Welcome, m.Refusal)
        if isinstance(reply, m.Refusal):
            raise IncompatiblePeer(f"KV producer at {host}:{port} refused: {reply.error}")
        if secret and not check_proof(secret, PRODUCER, first.challenge, ours,
                                      _bound(reply.transport, reply.params), reply.proof):
            raise IncompatiblePeer(f"KV producer at {host}:{port} did not prove the shared "
                                   f"secret: authentication failed")
        taken = next((o for o in offers if reply.transport in o.kinds), None)
        if taken is None:
            raise IncompatiblePeer(f"KV producer at {host}:{port} chose {reply.transport!r}, "
                                   f"which we did not offer")
        end = taken.taken(reply.transport, reply.params, link_key)
    except BaseException:
        for offer in offers:
            offer.close()
        sock.close()
        raise
    for offer in offers:
        if offer is not taken:
            offer.close()
    log.info("KV link %s up: %s", link_key, reply.transport)
    return Connection(sock, end, taken.key)


def answer(sock: socket.socket, *, engine_id: str, spec: KVSpec, secret: str | None,
           choose: Callable[[dict], tuple[str, ProducerEnd] | None]) -> ProducerEnd | None:
    """The producer's side: the open end for a consumer that passed, or None once it has been
    told why it did not."""
    challenge = secrets.token_hex(16)
    m.send(sock, m.Challenge(engine_id, challenge))
    hello = m.recv(sock, m.Hello)
    error = None
    if secret and not check_proof(secret, CONSUMER, challenge, hello.challenge, hello.link_key,
                                  hello.proof):
        error = "authentication failed: wrong or missing shared secret"
    elif not hello.link_key or len(hello.challenge) < 32:
        error = "malformed hello: a link key and a challenge of 16+ bytes are required"
    elif hello.expect_engine_id not in (None, engine_id):
        error = (f"engine id mismatch: consumer expected {hello.expect_engine_id!r}, "
                 f"this producer is {engine_id!r}")
    else:
        error = _incompatible(spec, hello.spec)
    chosen = None if error else choose(hello.offers)
    if chosen is None:
        error = error or f"no transport in common: offered {sorted(hello.offers)}"
        log.warning("refusing KV consumer %s: %s", hello.engine_id, error)
        m.send(sock, m.Refusal(error))
        return None
    name, end = chosen
    try:
        m.send(sock, m.Welcome(name, end.params,
                               _proof(secret, PRODUCER, challenge, hello.challenge,
                                      _bound(name, end.params))))
        end.open(hello.link_key)
    except BaseException:
        end.close()
        raise
    return end


def _incompatible(ours: KVSpec, theirs: dict) -> str | None:
    try:
        diffs = ours.differences(KVSpec.from_dict(theirs))
    except (TypeError, ValueError) as e:
        return f"malformed KV spec: {e}"
    return "incompatible KV cache: " + "; ".join(diffs) if diffs else None
