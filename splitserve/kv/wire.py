"""Side-channel wire format: length-prefixed JSON messages over a TCP socket, plus mutual auth.

The side channel carries only small control messages (messages.py: the handshake, "send
transfer T", replies); bulk KV bytes go by the connection's transport (transport/). JSON keeps
it debuggable with a packet capture, and a size cap keeps a confused or hostile peer from making
us allocate gigabytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
from typing import Any

MAX_MESSAGE_BYTES = 1 << 20
_HEADER = struct.Struct("!I")


class WireError(ConnectionError):
    """The side channel broke: peer gone, timeout, or a malformed message."""


def no_delay(sock: socket.socket) -> socket.socket:
    """Small messages go out at once. With Nagle's algorithm on, a message sent right after
    another that the peer has not answered (a pull's "read", then the next pull) waits for the
    peer's delayed ACK (40 ms on Linux), a floor under every pull."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # the peer is already gone: the first send or receive will say so
    return sock


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        sock.sendall(_HEADER.pack(len(body)) + body)
    except OSError as e:
        raise WireError(f"side channel send failed: {e}") from e


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    """One message; the socket's own timeout bounds the wait."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_MESSAGE_BYTES:
        raise WireError(f"peer announced a {size}-byte message (limit {MAX_MESSAGE_BYTES})")
    try:
        msg = json.loads(_recv_exact(sock, size))
    except ValueError as e:
        raise WireError(f"malformed side-channel message: {e}") from e
    if not isinstance(msg, dict):
        raise WireError("malformed side-channel message: not an object")
    return msg


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        try:
            chunk = sock.recv(n - got)
        except TimeoutError as e:
            raise WireError("side channel timed out waiting for the peer") from e
        except OSError as e:
            raise WireError(f"side channel receive failed: {e}") from e
        if not chunk:
            raise WireError("side channel closed by peer")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# Both sides prove the shared secret (mutual challenge-response). Each proof names its side and
# covers both challenges plus what that side's message commits to (the pair key the consumer
# chose, the store port the producer offers), so a proof cannot be reflected back at its
# sender, replayed on another connection, or kept while a man in the middle swaps the rest.
CONSUMER, PRODUCER = "consumer", "producer"


def auth_proof(secret: str, side: str, producer_challenge: str, consumer_challenge: str,
               bound: str) -> str:
    """HMAC proving `secret` without sending it."""
    text = "\n".join(["splitserve-kv/1", side, producer_challenge, consumer_challenge, bound])
    return hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()


def check_proof(secret: str, side: str, producer_challenge: str, consumer_challenge: str,
                bound: str, proof: object) -> bool:
    want = auth_proof(secret, side, producer_challenge, consumer_challenge, bound)
    return isinstance(proof, str) and hmac.compare_digest(want.encode(), proof.encode())
