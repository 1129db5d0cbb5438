"""The router vouches for the KV tickets it passes on, so decode workers dial only real producers.

A ticket tells a decode worker where to connect for a prompt's KV. Left unchecked, whoever
could hand a decode worker a ticket could make it dial any host:port. So a ticket reaches a
decode worker only through here: Prefill on a prefill worker → the ticket must name that
worker's own engine id and KV side-channel address, as it registered them (or as its Stats
said, for a static worker) → the router adds its voucher, an HMAC keyed with a key derived from
the cluster credential (`KVTicket.vouch`) → a decode worker holding the credential refuses any
ticket without a valid voucher before its engine sees it (decode_worker/servicer.py).

A ticket naming anything else is a failed Prefill (PERMISSION_DENIED from that worker): the
router's usual handling follows — the request migrates, and the transfer is released.
"""

from __future__ import annotations

import logging

import grpc

from splitserve.kv.ticket import KVTicket

log = logging.getLogger(__name__)


class VouchingPrefill:
    """A PrefillWorker stub whose Prefill returns only tickets the router vouches for."""

    def __init__(self, stub: object, engine_id: str, kv_address: str, key: bytes | None) -> None:
        self._stub = stub
        self.engine_id, self.kv_address, self._key = engine_id, kv_address, key

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def Prefill(self, request, **kwargs):
        resp = await self._stub.Prefill(request, **kwargs)
        if resp.HasField("ticket"):
            try:
                ticket = KVTicket.from_proto(resp.ticket)
            except ValueError as e:
                raise _refused(f"malformed ticket: {e}") from None
            where = f"{ticket.host}:{ticket.port}"
            if (ticket.engine_id, where) != (self.engine_id, self.kv_address):
                raise _refused(f"ticket names engine {ticket.engine_id!r} at {where}; this "
                               f"worker is {self.engine_id!r} at {self.kv_address or '(none)'}")
            if self._key is not None:
                resp.ticket.voucher = ticket.vouch(self._key).voucher
        return resp


def _refused(why: str) -> grpc.aio.AioRpcError:
    log.warning("refusing a KV ticket: %s", why)
    return grpc.aio.AioRpcError(grpc.StatusCode.PERMISSION_DENIED, grpc.aio.Metadata(),
                                grpc.aio.Metadata(), details=f"not vouched for: {why}")
