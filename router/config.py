"""Router configuration: one frozen dataclass, the one place each router setting is written
(splitserve/settings.py makes the flags of `router`, `up` and `ray up` from it)."""

from __future__ import annotations

from dataclasses import dataclass

from router.validation import RequestLimits
from splitserve.settings import setting
from splitserve.tls import TLSConfig


@dataclass(frozen=True)
class RouterConfig:
    # The model's HF directory (tokenizer, chat template, config.json): the launcher resolves
    # the engine's --model into it.
    model_dir: str = setting("", internal=True)
    model_name: str | None = setting(
        None, "served model name (default: the model directory's name)")
    # Benchmark tools send the path they were given, as vLLM accepts its `--model` argument.
    model_aliases: tuple[str, ...] = setting(
        (), "another name requests may use (repeatable); the --model value as given is always "
        "accepted, as vLLM does", flag="--model-alias", metavar="NAME")
    host: str = setting("127.0.0.1", "address to bind (0.0.0.0: all)")
    port: int = setting(
        50051, "gRPC port: the public Generation service, and the Registry unless "
        "--cluster-port (0: any free port)", flag="--grpc-port")
    # API clients have no client certificates, so the public port cannot demand them.
    cluster_port: int | None = setting(
        None, "serve the Registry here instead of on --grpc-port (mutual TLS with --tls-ca; 0: "
        "any free port)")
    http_port: int | None = setting(
        8000, "OpenAI-compatible HTTP API, /metrics and /health (0: any free port)")
    max_model_len: int = setting(
        4096, "prompt + max_tokens of one request, at most; as the workers' engines")
    max_concurrency: int = setting(64, "requests in flight through the router at once")
    max_queue: int = setting(
        256, "requests waiting for a slot; beyond it RESOURCE_EXHAUSTED / HTTP 429")
    admit_ttft_slo_s: float | None = setting(
        None, "refuse at once (gRPC RESOURCE_EXHAUSTED / HTTP 429, with a retry-after) a request "
        "whose predicted time to first token exceeds this (router/slo.py); default: queue every "
        "request (up to --max-queue)", flag="--admit-ttft-slo")
    admit_tpot_slo_s: float | None = setting(
        None, "likewise for the predicted time per output token, learnt from the router's own "
        "streams; default: no such check", flag="--admit-tpot-slo")
    # A KV transfer costs more than recomputing a few tokens.
    local_prefill_threshold: int = setting(
        0, "prompts shorter than this prefill on the decode worker (0: always disaggregate "
        "when prefill workers exist)")
    conditional_disaggregation: bool = setting(
        False, "decide per request whether to prefill on a prefill worker or on the decode "
        "worker, whichever adds less delay by live measurements (router/split.py); default: "
        "always on a prefill worker")
    tpot_slo_s: float | None = setting(
        None, "the time per output token promised to clients: with --conditional-"
        "disaggregation, no prompt prefills on a decode worker when that would push a stream "
        "decoding there past it; default: --admit-tpot-slo's value if set, else none",
        flag="--tpot-slo")
    prefix_affinity: bool = setting(
        True, "requests sharing a first KV block go to the same prefill and decode workers, "
        "within a load bound (router/policy.py)")
    heartbeat_interval_s: float = setting(1.0, internal=True)
    # Generous: on a small host whose cores the engines keep busy, a worker's event loop can
    # stall for seconds (3 s dropped live workers).
    heartbeat_timeout_s: float = setting(10.0, "drop a worker silent this long")
    static_prefill: tuple[str, ...] = setting(
        (), "a prefill worker that does not register (repeatable)", metavar="ADDR")
    static_decode: tuple[str, ...] = setting(
        (), "a decode worker that does not register (repeatable)", metavar="ADDR")
    static_colocated: tuple[str, ...] = setting(
        (), "a colocated worker that does not register (repeatable)", metavar="ADDR")
    # Clients must send `authorization: Bearer <one of these>` (none = open); workers must send
    # the cluster credential to register (None = anyone may). See splitserve/credentials.py.
    # Secrets come from the environment or files (deploy/security_flags.py), never flags.
    api_keys: tuple[str, ...] = setting((), internal=True, repr=False)
    cluster_token: str | None = setting(None, internal=True, repr=False)
    tls: TLSConfig | None = setting(None, internal=True)  # every listener and channel to workers
    limits: RequestLimits = setting(factory=RequestLimits, internal=True)  # flags of its own
    max_migrations: int = setting(
        2, "times a request whose worker failed is re-run on other workers (prompt + tokens so "
        "far)")
    drain_timeout_s: float = setting(
        30.0, "on SIGTERM, how long running requests may take to finish")
    uvloop: bool = setting(True, "run the event loop on uvloop where installed (off: asyncio's "
                                 "own)")
    # Same semantics as vLLM's --stream-interval; measured in bench/router_throughput.py.
    stream_interval: int = setting(
        1, "stream at least this many tokens per message (the first and the last at once); a "
        "request's sampling.stream_interval may raise it. Larger values cost every layer fewer "
        "messages per token, streams get burstier (1: every engine step as it comes, as vLLM)",
        metavar="TOKENS")

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
