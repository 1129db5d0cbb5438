"""What a Ray deployment is made of: one frozen config, the secrets apart, and the commands.

The deployment runs the same processes as `splitserve up` (`python -m deploy.cli router|prefill|
decode ...`); this module says, from the config alone, which command and which Ray resources
each actor gets, so the controller (controller.py) and the tests agree on them.
"""

from __future__ import annotations

import secrets as _secrets
from dataclasses import dataclass, field

from splitserve.credentials import API_KEY_ENV, CLUSTER_TOKEN_ENV, KV_SECRET_ENV
from splitserve.roles import Role

NAMESPACE = "splitserve"  # every deployment's actors live here, whatever the driver's namespace
POOLS = (Role.PREFILL, Role.DECODE)


@dataclass(frozen=True)
class AutoscaleConfig:
    """Bounds and pace of the SLO-driven autoscaler (autoscale.py); off unless given."""

    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    ttft_slo_s: float = 1.0  # p90 of time to first token the prefill pool is sized for
    tpot_slo_s: float = 0.1  # p90 of time per output token the decode pool is sized for
    interval_s: float = 10.0  # how often the router's metrics are read
    window_s: float = 60.0  # percentiles over the requests of this last window
    cooldown_s: float = 60.0  # after a change to a pool, how long that pool is left alone
    scale_down_ratio: float = 0.5  # a pool shrinks only when its signal is below ratio * SLO
    queue_per_worker: float = 4.0  # prefill: waiting requests per worker that count as behind
    kv_high: float = 0.85  # decode: KV cache usage that counts as full
    # splitserve/planner.py Profile fields (`splitserve plan`'s fit of measured runs): pools are
    # then never smaller than the planner's fewest workers for the observed rate.
    profile: dict[str, float] | None = None

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if not 0 <= lo <= hi:
                raise ValueError(f"autoscale: need 0 <= min_{role} <= max_{role}, got {lo}, {hi}")
        if self.min_decode < 1:
            raise ValueError("autoscale: min_decode must be >= 1 (decode workers serve)")


@dataclass(frozen=True)
class RayConfig:
    """One deployment. Ports: the router's (fixed, so a restarted router is where workers and
    clients expect it). `host`: where components bind and what they advertise; None binds all
    interfaces and advertises each node's IP (a multi-node cluster), tests use 127.0.0.1."""

    model: str = "tiny"
    prefill: int = 1
    decode: int = 1
    name: str = "splitserve"
    engine_args: tuple[str, ...] = ()  # the engine flags of `splitserve prefill|decode`
    router_args: tuple[str, ...] = ()  # more router flags (limits, concurrency)
    host: str | None = None
    grpc_port: int = 50051
    cluster_port: int = 50052
    http_port: int = 8000
    cpus_per_worker: float = 1.0  # Ray CPU resource of each worker actor (and cores pinned)
    gpus_per_worker: float = 0.0  # > 0 on GPU clusters: the actor's GPUs (CUDA_VISIBLE_DEVICES)
    router_cpus: float = 1.0
    max_restarts: int = 5  # a dead worker or router actor comes back this many times
    start_timeout_s: float = 600.0  # engines loading on a busy host take minutes
    drain_timeout_s: float = 40.0  # a worker's drain is bounded at 30 s by the worker itself
    placement: str = "SPREAD"  # placement group strategy of each pool's workers
    autoscale: AutoscaleConfig | None = None

    def __post_init__(self) -> None:
        if self.decode < 1:
            raise ValueError("a deployment needs at least one decode worker")
        if self.prefill < 0:
            raise ValueError("prefill workers cannot be negative")
        if self.placement not in ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"):
            raise ValueError(f"unknown placement strategy {self.placement!r}")

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_worker > 0

    def bundle(self) -> dict[str, float]:
        """The Ray resources of one worker actor (one placement-group bundle)."""
        if self.on_gpu:
            return {"CPU": self.cpus_per_worker, "GPU": self.gpus_per_worker}
        return {"CPU": self.cpus_per_worker}

    def router_argv(self, bind: str) -> list[str]:
        return ["router", "--model", self.model, "--host", bind, "--grpc-port",
                str(self.grpc_port), "--cluster-port", str(self.cluster_port), "--http-port",
                str(self.http_port), *self.router_args]

    def worker_argv(self, role: Role, worker_id: str, router: str, bind: str, advertise: str,
                    cores: str) -> list[str]:
        return [role.value, "--model", self.model, "--router", router, "--worker-id", worker_id,
                "--host", bind, "--advertise-host", advertise, "--kv-host", advertise,
                "--port", "0", "--metrics-port", "0", "--cpu-cores", cores,
                *self.engine_args]


@dataclass(frozen=True)
class Secrets:
    """The deployment's credentials. They reach each component process in its environment,
    never its command line (docs/security.md); each actor gets them as a constructor argument,
    which Ray keeps in its control store: whoever can use the Ray cluster can read them, as
    they can run any code there."""

    cluster_token: str = field(repr=False)
    kv_secret: str = field(repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)

    @classmethod
    def make(cls, cluster_token: str | None = None, kv_secret: str | None = None,
             api_keys: tuple[str, ...] = ()) -> Secrets:
        """Fresh credentials for what is not given (clients must be told API keys, so those
        are never invented)."""
        return cls(cluster_token or _secrets.token_urlsafe(32),
                   kv_secret or _secrets.token_urlsafe(32), tuple(api_keys))

    def env(self, role: Role | None) -> dict[str, str]:
        """A component's secrets: the router gets the API keys, workers the KV secret."""
        out = {CLUSTER_TOKEN_ENV: self.cluster_token}
        if role is None:
            if self.api_keys:
                out[API_KEY_ENV] = "\n".join(self.api_keys)
        else:
            out[KV_SECRET_ENV] = self.kv_secret
        return out
