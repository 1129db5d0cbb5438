"""Worker metrics (Prometheus) on the worker's own /metrics port.

Served from the default registry, so vLLM's own `vllm:*` engine metrics (its Prometheus stat
logger stays on) come out of the same endpoint next to ours. Load gauges are read from the
EngineMonitor at scrape time; KV transfers are counted as vLLM delivers their stats.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from splitserve.kv.stats import TransferSample
from splitserve.tls import TLSConfig, warn_if_exposed
from splitserve.worker.core import WorkerCore

_TRANSFER_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LABELS = ["model_name", "role", "worker"]


class _Collector:
    def __init__(self, core: WorkerCore, labels: list[str]) -> None:
        self.core, self.labels = core, labels

    def collect(self):
        s, core, lv = self.core.monitor.snapshot(), self.core, self.labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, value)
            return c

        yield gauge("splitserve:worker_queue_len", "RPCs being served by this worker",
                    core.inflight)
        e = core.cfg.engine
        info = GaugeMetricFamily("splitserve:engine_config", "What this worker's engine does "
                                 "(always 1; the labels say it)",
                                 labels=[*LABELS, "kv_cache_dtype", "speculative_tokens"])
        info.add_metric([*lv, e.kv_cache_dtype, str(e.speculative_tokens)], 1)
        yield info
        yield gauge("splitserve:engine_num_requests_running", "Requests running in the engine",
                    s.num_running)
        yield gauge("splitserve:engine_num_requests_waiting", "Requests waiting in the engine",
                    s.num_waiting)
        yield gauge("splitserve:kv_cache_usage_perc", "Fraction of KV blocks in use",
                    s.kv_cache_usage)
        yield gauge("splitserve:worker_serving", "1 when serving, 0 loading or draining",
                    float(core.phase.name == "SERVING"))
        yield counter("splitserve:prefix_cache_queries", "Prefix cache queries (tokens)",
                      s.prefix_cache_queries)
        yield counter("splitserve:prefix_cache_hits", "Prefix cache hits (tokens)",
                      s.prefix_cache_hits)
        yield counter("splitserve:spec_draft_tokens", "Speculative tokens proposed",
                      s.spec_draft_tokens)
        yield counter("splitserve:spec_accepted_tokens", "Speculative tokens accepted",
                      s.spec_accepted_tokens)
        kv = core.kv_transfers()  # prefill role; {} otherwise
        yield gauge("splitserve:kv_held_transfers", "KV transfers held for a decode worker",
                    kv.get("held", 0) + kv.get("claimed", 0))
        yield gauge("splitserve:kv_held_blocks", "KV blocks held for a decode worker",
                    kv.get("held_blocks", 0))
        yield counter("splitserve:kv_released", "Held KV released unpulled (router or consumer)",
                      kv.get("released", 0))
        t = s.transfers
        yield counter("splitserve:kv_transfers", "KV transfers completed", t.transfers)
        yield counter("splitserve:kv_shm_transfers", "KV transfers through shared memory "
                      "(same host; the rest took the pair channel)", t.shm_transfers)
        yield counter("splitserve:kv_arena_transfers", "KV transfers read straight out of the "
                      "producer's shared hold arena (of the shared-memory ones)",
                      t.arena_transfers)
        yield counter("splitserve:kv_transfer_bytes", "KV bytes transferred", t.bytes)
        yield counter("splitserve:kv_transfer_failures", "KV transfers failed", t.failures)
        yield counter("splitserve:kv_lease_expired", "KV leases expired unpulled",
                      t.lease_expired)


def start_metrics(core: WorkerCore, host: str, port: int, tls: TLSConfig | None = None) -> int:
    """Serve /metrics (HTTPS with `tls`); returns the bound port (port 0 picks one). No client
    certificate is asked for: metrics carry counts, never prompts, and scrapers rarely have one.
    """
    labels = [core.served_model, core.cfg.role.value, core.cfg.engine.engine_id or ""]
    REGISTRY.register(_Collector(core, labels))
    seconds = Histogram("splitserve:kv_transfer_seconds", "Duration of one KV transfer",
                        LABELS, buckets=_TRANSFER_S).labels(*labels)

    def on_transfers(sample: TransferSample) -> None:
        for _, secs in sample.samples:
            seconds.observe(secs)

    core.monitor.on_transfers(on_transfers)
    if tls is None:
        warn_if_exposed(host, "metrics")
        server, _ = start_http_server(port, addr=host)
    else:
        server, _ = start_http_server(port, addr=host, certfile=tls.cert, keyfile=tls.key)
    return server.server_port
