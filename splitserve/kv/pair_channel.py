"""Pair channels: one 2-rank torch.distributed process group per (producer, consumer) pair.

There is no global `init_process_group`: each producer worker hosts one TCPStore, and every pair
gets its own `PrefixStore(pair_key, store)` on it, so any number of pairs share a process without
knowing about each other. Rank 0 is the producer (it sends), rank 1 the consumer (it receives).
Gloo serves CPU KV caches, NCCL CUDA ones: the choice follows the device of the tensors, the code
path is the same.

A process group that failed (timeout, peer gone) is never reused: gloo leaves it in an undefined
state. The owner closes it and the next transfer builds a fresh one under a new pair key.
"""

from __future__ import annotations

import datetime
import logging

import torch
from torch.distributed import PrefixStore, Store, TCPStore

from splitserve.kv.transport import TransportError

log = logging.getLogger(__name__)

PRODUCER_RANK = 0
CONSUMER_RANK = 1


# A transfer on a pair channel failed or timed out; the channel must be discarded.
TransferError = TransportError


def host_store(host: str, port: int = 0, timeout_s: float = 30.0) -> TCPStore:
    """The producer's rendezvous store; port 0 picks a free one (read it back from `.port`)."""
    return TCPStore(host, port, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def connect_store(host: str, port: int, timeout_s: float = 30.0) -> TCPStore:
    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class PairChannel:
    """A connected 2-rank process group plus a reusable staging buffer.

    Not thread-safe: its owner (one side-channel connection) runs one transfer at a time.
    """

    def __init__(self, store: Store, pair_key: str, rank: int, device: torch.device,
                 timeout_s: float, iface_host: str = "127.0.0.1") -> None:
        self.pair_key = pair_key
        self.rank = rank
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._staging: torch.Tensor | None = None
        self.closed = False
        prefix = PrefixStore(pair_key, store)
        # Blocks until the peer joins (or the timeout passes): both sides construct at once.
        if device.type == "cuda":
            from torch._C._distributed_c10d import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = ProcessGroupNCCL(prefix, rank, 2, opts)
        else:
            from torch._C._distributed_c10d import ProcessGroupGloo

            opts = ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=iface_host)]
            self.pg = ProcessGroupGloo(prefix, rank, 2, opts)

    def staging(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes`, grown but never reallocated per transfer."""
        buf = self._staging
        if buf is None or buf.numel() < nbytes:
            # Grow geometrically so slowly rising prompt lengths do not reallocate every time.
            size = max(nbytes, 2 * buf.numel() if buf is not None else 0)
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._staging = buf
        return buf[:nbytes]

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        self._run(lambda: self.pg.send([tensor], 1 - self.rank, tag), "send", tensor)

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        self._run(lambda: self.pg.recv([tensor], 1 - self.rank, tag), "recv", tensor)

    def _run(self, op, what: str, tensor: torch.Tensor) -> None:
        if self.closed:
            raise TransferError(f"pair {self.pair_key}: channel already closed")
        try:
            work = op()
            if not work.wait(self.timeout):
                raise TransferError(f"pair {self.pair_key}: {what} timed out")
        except TransferError:
            self.close()
            raise
        except RuntimeError as e:  # gloo: peer closed, timeout, connection reset
            self.close()
            raise TransferError(f"pair {self.pair_key}: {what} of {tensor.numel()} elements "
                                f"failed: {e}") from e

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if hasattr(self.pg, "abort"):
                self.pg.abort()
        except Exception:  # best effort: the group is being discarded anyway
            log.debug("pair %s: abort failed", self.pair_key, exc_info=True)
