"""What a worker knows about its engine between steps: load, KV usage, transfer totals.

vLLM hands every step's `SchedulerStats` to the stat loggers in the API process (ours included,
next to vLLM's own Prometheus logger, which stays on). `EngineMonitor` keeps the latest snapshot
for heartbeats, Stats RPCs and leak checks, and accumulates our connector's transfer stats.
The stats of a step are taken after it freed blocks, so once the engine goes idle the snapshot
says how many blocks are really still in use.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from splitserve.kv.stats import TransferSample


@dataclass
class EngineSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use (prefix-cached but free = free)
    steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding since start: draft tokens proposed and accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    transfers: TransferSample = field(default_factory=TransferSample)


class EngineMonitor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap = EngineSnapshot()
        self._listeners: list = []

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            s = self._snap
            return EngineSnapshot(s.num_running, s.num_waiting, s.kv_cache_usage, s.steps,
                                  s.prefix_cache_queries, s.prefix_cache_hits,
                                  s.spec_draft_tokens, s.spec_accepted_tokens,
                                  s.transfers.totals())

    def on_transfers(self, fn) -> None:
        """Call fn(TransferSample) for each step's transfer stats (metrics exporters)."""
        self._listeners.append(fn)

    def factory(self, vllm_config: Any, engine_index: int = 0) -> StatLoggerBase:
        return _MonitorLogger(self)

    def _record(self, stats: Any) -> None:
        sample = None
        with self._lock:
            s = self._snap
            s.num_running = stats.num_running_reqs
            s.num_waiting = stats.num_waiting_reqs + stats.num_skipped_waiting_reqs
            s.kv_cache_usage = stats.kv_cache_usage
            s.steps += 1
            s.prefix_cache_queries += stats.prefix_cache_stats.queries
            s.prefix_cache_hits += stats.prefix_cache_stats.hits
            if stats.spec_decoding_stats is not None:
                s.spec_draft_tokens += stats.spec_decoding_stats.num_draft_tokens
                s.spec_accepted_tokens += stats.spec_decoding_stats.num_accepted_tokens
            if stats.kv_connector_stats:
                sample = TransferSample.from_dict(stats.kv_connector_stats)
                s.transfers.merge(sample.totals())
        if sample is not None:
            for fn in self._listeners:
                fn(sample)


class _MonitorLogger(StatLoggerBase):
    def __init__(self, monitor: EngineMonitor) -> None:
        self.monitor = monitor

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is not None:
            self.monitor._record(scheduler_stats)

    def log_engine_initialized(self) -> None:
        pass
