"""Router configuration: one frozen dataclass, filled from CLI flags in one place (cli)."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.validation import RequestLimits
from splitserve.tls import TLSConfig


@dataclass(frozen=True)
class RouterConfig:
    model_dir: str  # the model's HF directory: tokenizer.json, tokenizer_config.json, config.json
    model_name: str | None = None  # served name; defaults to the directory's name
    # Other names requests may use for the same model, as vLLM accepts its `--model` argument
    # (benchmark tools send the path they were given).
    model_aliases: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 50051  # gRPC (public Generation, and the Registry unless cluster_port); 0 = any
    # The Registry on a port of its own, with mutual TLS when `tls` has a CA (the public port
    # cannot demand client certificates: API clients have none). None = on the public port.
    cluster_port: int | None = None
    http_port: int | None = None  # OpenAI-compatible HTTP + /metrics + /health; None = off
    max_model_len: int = 4096  # prompt + max_tokens limit; must match the workers' engines
    max_concurrency: int = 64  # requests in flight through the router at once
    max_queue: int = 256  # requests waiting for a slot; beyond it RESOURCE_EXHAUSTED
    # Refuse at once (RESOURCE_EXHAUSTED / 429 with a retry-after) a request whose predicted time
    # to first token exceeds this many seconds (router/slo.py). None = queue everything.
    admit_ttft_slo_s: float | None = None
    # The same for the predicted time per output token (router/slo.py). None = no such check.
    admit_tpot_slo_s: float | None = None
    # Prompts shorter than this prefill on the decode worker: a KV transfer costs more than
    # recomputing a few tokens. 0 = always disaggregate when prefill workers exist.
    local_prefill_threshold: int = 0
    # Per request, prefill remotely or on the decode worker, whichever adds less delay by the
    # router's live measurements (router/split.py). Off: always remote (within the threshold).
    conditional_disaggregation: bool = False
    # The time per output token promised to clients: conditional disaggregation prefills no
    # prompt on a decode worker where that would push a stream decoding there past it
    # (router/split.py). None = admit_tpot_slo_s's value (None too: seconds alone decide).
    tpot_slo_s: float | None = None
    # Requests sharing a first KV block go to the same prefill and decode workers, within a
    # load bound (router/policy.py). Off: least queued prompt tokens / power of two choices.
    prefix_affinity: bool = True
    heartbeat_interval_s: float = 1.0
    # A worker silent this long is dropped. Generous: on a small host whose cores the engines
    # keep busy, a worker's event loop can stall for seconds (3 s dropped live workers).
    heartbeat_timeout_s: float = 10.0
    static_prefill: tuple[str, ...] = ()
    static_decode: tuple[str, ...] = ()
    static_colocated: tuple[str, ...] = ()
    # Clients must send `authorization: Bearer <one of these>` (none = open); workers must send
    # the cluster credential to register (None = anyone may). See splitserve/credentials.py.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    cluster_token: str | None = field(default=None, repr=False)
    tls: TLSConfig | None = None  # every listener and every channel to workers; None = plaintext
    limits: RequestLimits = field(default_factory=RequestLimits)
    # A request whose worker fails is re-run on others (prompt + tokens so far) this many times.
    max_migrations: int = 2
    # On SIGTERM: refuse new requests, let running ones finish for at most this long, then stop.
    drain_timeout_s: float = 30.0
    # Tokens per streamed message, at least, for every request (a request may ask for more):
    # the engines hold tokens back until this many are ready, so every layer sends fewer
    # messages. 1 = every engine step as it comes, as vLLM's default. Same semantics as vLLM's
    # --stream-interval; measured in bench/router_throughput.py.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "max_model_len", "heartbeat_interval_s",
                     "stream_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        for name in ("admit_ttft_slo_s", "admit_tpot_slo_s", "tpot_slo_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
