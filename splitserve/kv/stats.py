"""Per-transfer observations (bytes, seconds, failures, lease expiries), collected thread-safely.

The worker half drains them every engine step (`drain()`); vLLM carries the dict to the API
process as KV-connector stats, where the worker servers turn them into Prometheus metrics.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

SAME_HOST = ("shm", "arena")  # the paths that count as shm_transfers


@dataclass
class TransferSample:
    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    lease_expired: int = 0
    shm_transfers: int = 0  # of `transfers`, those through shared memory (same host, shm.py)
    arena_transfers: int = 0  # of those, read straight out of the producer's hold arena
    # Per-transfer (bytes, seconds) pairs, so a histogram of GB/s can be built downstream.
    samples: list[tuple[int, float]] = field(default_factory=list)

    def merge(self, other: TransferSample) -> None:
        self.transfers += other.transfers
        self.bytes += other.bytes
        self.seconds += other.seconds
        self.failures += other.failures
        self.lease_expired += other.lease_expired
        self.shm_transfers += other.shm_transfers
        self.arena_transfers += other.arena_transfers
        self.samples.extend(other.samples)

    def totals(self) -> TransferSample:
        """The counters alone: running totals must not keep every transfer's (bytes, s)."""
        return TransferSample(self.transfers, self.bytes, self.seconds, self.failures,
                              self.lease_expired, self.shm_transfers, self.arena_transfers)

    def is_empty(self) -> bool:
        return not (self.transfers or self.failures or self.lease_expired)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TransferSample:
        s = cls(**{k: v for k, v in d.items() if k != "samples"})
        s.samples = [tuple(x) for x in d.get("samples", [])]
        return s


class TransferStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = TransferSample()
        self.total = TransferSample()  # since start, for logs and tests

    def record_transfer(self, nbytes: int, seconds: float, path: str = "pair") -> None:
        """One transfer, by the path its bytes took (a transport's label: transport/)."""
        self._add(TransferSample(1, nbytes, seconds, shm_transfers=int(path in SAME_HOST),
                                 arena_transfers=int(path == "arena"),
                                 samples=[(nbytes, seconds)]))

    def record_failure(self) -> None:
        self._add(TransferSample(failures=1))

    def record_lease_expired(self) -> None:
        self._add(TransferSample(lease_expired=1))

    def _add(self, s: TransferSample) -> None:
        with self._lock:
            self._pending.merge(s)
            self.total.merge(s.totals())

    def drain(self) -> TransferSample:
        with self._lock:
            out, self._pending = self._pending, TransferSample()
        return out
