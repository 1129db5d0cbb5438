"""The deployment's state, in one named Ray actor: router, pools, placement groups, scaling.

Lifecycle: `start()` starts the router actor, then each pool's worker actors in placement groups,
and returns once every worker has registered with the router. `scale(prefill, decode)` first
starts what a pool gains and waits until the router lists it, then drains what a pool loses (a
draining worker deregisters and finishes what it runs), so a resize never leaves a pool empty
of registered workers. `shutdown()` drains workers, then the router, then kills the actors and
removes the placement groups. Being a named actor in the `splitserve` namespace, the controller
is what `splitserve ray scale|status|down` find from any other driver; the component actors are
its own (Ray ends them with it), so nothing outlives the deployment.

The autoscaler (autoscale.py), when configured, is a thread here that calls `scale` as any
client would.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deploy.ray.component import Component, ComponentSpec
from deploy.ray.config import NAMESPACE, POOLS, RayConfig, Secrets
from splitserve.credentials import bearer
from splitserve.roles import Role
from splitserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)


def kill(actors: list[ray.actor.ActorHandle], timeout_s: float = 30.0) -> None:
    """Kill the actors and return once Ray reports them dead. `ray.kill` only asks: the control
    store lists a killed actor as alive until its process is gone, so a `down` that returned
    at once could leave a name another driver still finds (and a new deploy of it refused)."""
    for a in actors:
        ray.kill(a, no_restart=True)
    deadline = time.monotonic() + timeout_s
    for a in actors:
        while True:
            try:  # a dead actor fails every call with RayActorError
                ray.get(a.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                pass  # not reachable yet is not dead
            except ray.exceptions.RayActorError:
                break
            if time.monotonic() > deadline:
                log.warning("actor %s still alive %.0f s after kill", a, timeout_s)
                break
            time.sleep(0.05)


@dataclass
class Slot:
    name: str
    role: Role
    index: int
    actor: ray.actor.ActorHandle
    group: str  # its placement group's id (hex)


class Controller:
    def __init__(self, cfg: RayConfig, secrets: Secrets) -> None:
        self.cfg, self.secrets = cfg, secrets
        self.lock = threading.RLock()  # one change of membership at a time
        self.router: ray.actor.ActorHandle | None = None
        self.endpoints: dict[str, str] = {}
        self.pools: dict[Role, list[Slot]] = {r: [] for r in POOLS}
        self.groups: dict[str, tuple[object, set[str]]] = {}  # id -> (group, live slots)
        self.events: list[dict] = []  # what was scaled, when, and why
        self.autoscaler = None
        self.stopped = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> dict[str, str]:
        with self.lock:
            self.router = self._actor(ComponentSpec(f"{self.cfg.name}-router", None),
                                      num_cpus=self.cfg.router_cpus)
            self.endpoints = ray.get(self.router.ready.remote(), timeout=120)
            self.scale(self.cfg.prefill, self.cfg.decode, reason="start")
            if self.cfg.autoscale is not None:
                from deploy.ray.autoscale import Autoscaler

                self.autoscaler = Autoscaler(self, self.cfg.autoscale)
                self.autoscaler.start()
            return dict(self.endpoints)

    def shutdown(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.stop()
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            slots = [s for r in POOLS for s in self.pools[r]]
            self._drain(slots)  # workers first: they deregister while the router still runs
            if self.router is not None:
                self._stop_actors([self.router])
            for pg, _ in self.groups.values():
                remove_placement_group(pg)
            self.groups.clear()

    # -- scaling -----------------------------------------------------------------------------
    def scale(self, prefill: int | None = None, decode: int | None = None,
              reason: str = "requested") -> dict:
        """Resize the pools (None: leave as is); returns once the new workers are registered
        and the removed ones drained."""
        with self.lock:
            if self.stopped:
                raise RuntimeError("the deployment is shut down")
            want = {Role.PREFILL: len(self.pools[Role.PREFILL]) if prefill is None else prefill,
                    Role.DECODE: len(self.pools[Role.DECODE]) if decode is None else decode}
            if want[Role.DECODE] < 1 or want[Role.PREFILL] < 0:
                raise ValueError(f"need decode >= 1 and prefill >= 0, got {want}")
            added = [s for r in POOLS for s in self._grow(r, want[r] - len(self.pools[r]))]
            try:
                ray.get([s.actor.ready.remote() for s in added],
                        timeout=self.cfg.start_timeout_s)
                self._wait_registered(want)
            except Exception:
                self._drain(added)  # a failed grow leaves the deployment as it was
                raise
            victims = [s for r in POOLS for s in self.pools[r][want[r]:]]
            self._drain(victims)
            if added or victims:
                self.events.append({"t": time.time(), "reason": reason,
                                    "prefill": want[Role.PREFILL], "decode": want[Role.DECODE]})
                log.warning("deployment %s scaled to %dP%dD (%s)", self.cfg.name,
                            want[Role.PREFILL], want[Role.DECODE], reason)
            return self.status()

    def _grow(self, role: Role, n: int) -> list[Slot]:
        if n <= 0:
            return []
        # One placement group per growth step of a pool: its bundles spread over the nodes.
        pg = placement_group([self.cfg.bundle()] * n, strategy=self.cfg.placement)
        try:
            ray.get(pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(f"the Ray cluster cannot place {n} more {role} worker(s) of "
                               f"{self.cfg.bundle()} (see `ray status`)") from None
        gid = pg.id.hex()
        self.groups[gid] = (pg, set())
        used = {s.index for s in self.pools[role]}
        out = []
        for bundle in range(n):
            index = min(i for i in range(len(used) + n + 1) if i not in used)
            used.add(index)
            name = f"{self.cfg.name}-{role}-{index}"
            spec = ComponentSpec(name, role, ordinal=2 * index + (role is Role.DECODE),
                                 router=self.endpoints["cluster"])
            actor = self._actor(spec, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=bundle), num_cpus=self.cfg.cpus_per_worker,
                num_gpus=self.cfg.gpus_per_worker)
            slot = Slot(name, role, index, actor, gid)
            self.groups[gid][1].add(name)
            self.pools[role].append(slot)
            out.append(slot)
        return out

    def _actor(self, spec: ComponentSpec, **resources) -> ray.actor.ActorHandle:
        return ray.remote(Component).options(
            name=spec.name, namespace=NAMESPACE, max_restarts=self.cfg.max_restarts,
            max_concurrency=4,  # info() answers while ready() waits for an engine
            **resources).remote(self.cfg, spec, self.secrets)

    def _wait_registered(self, want: dict[Role, int]) -> None:
        """Until the router lists at least `want` workers of each pool."""
        deadline = time.monotonic() + 120
        keys = self.secrets.api_keys
        with grpc.insecure_channel(self.endpoints["grpc"]) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            while True:
                try:
                    (m,) = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=5,
                                           metadata=bearer(keys[0] if keys else None)).models
                    if (m.prefill_workers >= want[Role.PREFILL]
                            and m.decode_workers >= want[Role.DECODE]):
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not register with the router: want {want}")
                time.sleep(0.25)

    def _drain(self, slots: list[Slot]) -> None:
        """Drain in parallel, then kill the actors and free their placement groups."""
        self._stop_actors([s.actor for s in slots])
        for s in slots:
            if s in self.pools[s.role]:
                self.pools[s.role].remove(s)
            pg, live = self.groups.get(s.group, (None, set()))
            live.discard(s.name)
            if pg is not None and not live:
                remove_placement_group(pg)
                del self.groups[s.group]

    def _stop_actors(self, actors: list[ray.actor.ActorHandle]) -> None:
        """Drain in parallel, then kill (and wait for the deaths)."""
        try:
            ray.get([a.drain.remote() for a in actors], timeout=self.cfg.drain_timeout_s + 30)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            log.warning("drain: %s (the actors are killed anyway)", e)
        kill(actors)

    # -- reading -----------------------------------------------------------------------------
    def status(self) -> dict:
        def info(actor) -> dict:
            try:
                return ray.get(actor.info.remote(), timeout=10)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                return {"state": f"unavailable ({type(e).__name__})"}

        # No lock: a status must answer while a resize waits for engines (a snapshot of lists).
        pools = {r: list(self.pools[r]) for r in POOLS}
        return {"name": self.cfg.name, "router": dict(self.endpoints),
                "router_info": info(self.router) if self.router else None,
                "pools": {r.value: [{"name": s.name, **info(s.actor)} for s in pools[r]]
                          for r in POOLS},
                "events": list(self.events),
                "autoscale": None if self.autoscaler is None else self.autoscaler.report()}

    def sizes(self) -> dict[str, int]:
        return {r.value: len(self.pools[r]) for r in POOLS}
