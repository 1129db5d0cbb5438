"""The Python API of a Ray deployment: `deploy(...)` → a `Deployment` handle; `connect(name)`.

    import deploy.ray as ssray                 # splitserve's composition layer (deploy/)
    d = ssray.deploy("tiny", prefill=1, decode=1, address="auto")
    d.address                                  # the router's gRPC address; d.http: OpenAI API
    d.scale(prefill=2, decode=2)               # new workers register before old ones drain
    d.shutdown()

`deploy` joins the Ray cluster at `address` (None: the one this driver is already connected to,
else a new local one), starts the controller actor (controller.py) and waits until every
worker has registered. The controller is owned by this driver unless `detached=True`, in which
case it (and the deployment) outlive the driver until `connect(name).shutdown()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray

from deploy.ray.config import NAMESPACE, AutoscaleConfig, RayConfig, Secrets
from deploy.ray.controller import Controller, kill
from splitserve.credentials import CLUSTER_TOKEN_ENV, KV_SECRET_ENV


def _join(address: str | None, num_cpus: int | None = None) -> None:
    if ray.is_initialized():
        return
    if address is None:  # a new local cluster, which lives as long as this driver
        # Ray starts its workers at nice 15, and our engines and servers are its workers' children:
        # at that niceness anything else on the node takes their CPU first. The raylet reads this
        # when it starts, so it holds for the cluster started here (see Component for others).
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(num_cpus=num_cpus, include_dashboard=False)
    else:
        ray.init(address=address)


@dataclass
class Deployment:
    """A handle on a running deployment; any driver can make one with `connect`."""

    name: str
    controller: ray.actor.ActorHandle
    endpoints: dict[str, str]

    @property
    def address(self) -> str:
        """The router's gRPC address (`splitserve generate --router ...`)."""
        return self.endpoints["grpc"]

    @property
    def http(self) -> str | None:
        """The router's HTTP base (OpenAI API under /v1, Prometheus metrics at /metrics)."""
        return self.endpoints.get("http")

    def scale(self, prefill: int | None = None, decode: int | None = None) -> dict:
        return ray.get(self.controller.scale.remote(prefill, decode))

    def status(self) -> dict:
        return ray.get(self.controller.status.remote())

    def sizes(self) -> dict[str, int]:
        return ray.get(self.controller.sizes.remote())

    def shutdown(self) -> None:
        """Drain and stop everything; the controller goes last."""
        try:
            ray.get(self.controller.shutdown.remote())
        finally:
            kill([self.controller])


def deploy(model: str = "tiny", prefill: int = 1, decode: int = 1, *, address: str | None = None,
           detached: bool = False, api_keys: tuple[str, ...] = (),
           autoscale: AutoscaleConfig | None = None, **options) -> Deployment:
    """Start a deployment; `options` are RayConfig's fields (ports, resources, engine_args...).
    The cluster credential and KV secret come from $SPLITSERVE_CLUSTER_TOKEN /
    $SPLITSERVE_KV_SECRET when set, else are generated for this deployment."""
    cfg = RayConfig(model=model, prefill=prefill, decode=decode, autoscale=autoscale,
                    **options)
    secrets = Secrets.make(os.environ.get(CLUSTER_TOKEN_ENV), os.environ.get(KV_SECRET_ENV),
                           api_keys)
    _join(address, num_cpus=max(os.cpu_count() or 1, _cpus_needed(cfg)))
    try:
        ray.get_actor(cfg.name, namespace=NAMESPACE)
    except ValueError:
        pass  # no such actor: the name is free
    else:
        raise ValueError(f"a deployment named {cfg.name!r} is already running "
                         f"(`splitserve ray down --name {cfg.name}` stops it)")
    ctrl = ray.remote(Controller).options(
        name=cfg.name, namespace=NAMESPACE, lifetime="detached" if detached else None,
        num_cpus=0, max_concurrency=8, max_restarts=0).remote(cfg, secrets)
    d = Deployment(cfg.name, ctrl, {})
    try:
        d.endpoints = ray.get(ctrl.start.remote())
    except BaseException:
        d.shutdown()  # whatever started, stops: a failed deploy leaves nothing running
        raise
    return d


def connect(name: str = "splitserve", address: str | None = "auto") -> Deployment:
    """The handle of a running deployment, from any driver."""
    _join(address)
    try:
        ctrl = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise ValueError(f"no deployment named {name!r} on this Ray cluster") from None
    return Deployment(name, ctrl, ray.get(ctrl.status.remote())["router"])


def _cpus_needed(cfg: RayConfig) -> int:
    """Logical CPUs a new local cluster needs for the first deployment (Ray counts them, it
    does not pin them: oversubscribing a laptop is what `splitserve up` does too)."""
    return int(cfg.router_cpus + (cfg.prefill + cfg.decode) * cfg.cpus_per_worker + 0.999)
