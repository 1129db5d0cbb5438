"""One splitserve process (router, prefill or decode worker) supervised by one Ray actor.

Lifecycle of a `Component` actor:
  __init__  (every incarnation) kill what a previous incarnation of this actor left on this node
            (its pid file), then start `python -m deploy.cli <role> ...` — the command
            `splitserve up` runs — with the secrets in its environment, and watch it.
  ready()   wait until the process serves; its endpoints, with the node's address.
  (running) the process heartbeats to the router on its own. If it exits without being asked,
            the actor exits too, so Ray restarts the actor (max_restarts) and a new process
            registers under the same worker id, replacing the dead one in the router at once.
  drain()   SIGTERM: a worker deregisters and finishes what it runs (30 s at most), a router
            stops taking calls and finishes its streams; then nothing of it is left.
If the actor itself dies (killed, node trouble), the process drains and stops on its own
(splitserve/lifeline.py), and a restarted actor on the same node kills it at once: on a GPU the
new engine needs the memory the old one holds.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.procs import Proc, ProcessSet
from deploy.ray.config import RayConfig, Secrets
from splitserve.credentials import API_KEY_ENV, CLUSTER_TOKEN_ENV, KV_SECRET_ENV
from splitserve.procstat import proc_stat
from splitserve.roles import Role

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ComponentSpec:
    name: str  # the actor's name and the worker id: stable across restarts
    role: Role | None  # None: the router
    ordinal: int = 0  # workers: the n-th worker of the deployment (which cores it takes)
    router: str = ""  # workers: the router's cluster (Registry) address


def state_dir(deployment: str) -> Path:
    """Per node: component logs and pid files of a deployment."""
    d = Path(tempfile.gettempdir()) / "splitserve-ray" / deployment
    d.mkdir(parents=True, exist_ok=True)
    return d


def _start_time(pid: int) -> str | None:
    """The start time, so a reused pid is not mistaken for ours; None once the process is gone
    (a zombie counts as gone: it holds nothing). A string, as pid files have always held it."""
    st = proc_stat(pid)
    return str(st.start_ticks) if st is not None and st.alive else None


def _cores(cfg: RayConfig, ordinal: int) -> str:
    """CPU engines: cores of their own, round-robin by worker ordinal (as `splitserve up` does:
    vLLM's default binds every engine on a host to the same core)."""
    if cfg.on_gpu:
        return "auto"
    cores = sorted(os.sched_getaffinity(0))
    k = max(1, int(cfg.cpus_per_worker))
    return ",".join(str(cores[(ordinal * k + j) % len(cores)]) for j in range(min(k, len(cores))))


def _normal_priority(name: str) -> None:
    """Ray runs its workers at nice 15 unless the cluster was started with
    RAY_worker_niceness=0; a serving process (and its engine) at nice 15 loses every contended
    time slice to whatever else runs on the node. Back to 0 where we may; say so where not."""
    if os.getpriority(os.PRIO_PROCESS, 0) <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        log.warning("%s: Ray runs this worker at nice %d and we may not lower it; start the Ray "
                    "cluster with RAY_worker_niceness=0 so serving does not lose its CPU",
                    name, os.getpriority(os.PRIO_PROCESS, 0))


class Component:
    """The actor class (made remote by the controller, with its resources and restarts)."""

    def __init__(self, cfg: RayConfig, spec: ComponentSpec, secrets: Secrets) -> None:
        import ray

        self.cfg, self.spec = cfg, spec
        self.node_ip = ray.util.get_node_ip_address()
        self.dir = state_dir(cfg.name)
        self.pid_file = self.dir / f"{spec.name}.pid"
        self._kill_previous()
        bind = cfg.host or "0.0.0.0"
        advertise = cfg.host or self.node_ip
        if spec.role is None:
            argv = cfg.router_argv(bind)
        else:
            argv = cfg.worker_argv(spec.role, spec.name, spec.router, bind, advertise,
                                   _cores(cfg, spec.ordinal))
        # Ray starts its workers from the raylet's environment, which may carry a driver's
        # secrets; each process gets exactly its own.
        env = {k: v for k, v in os.environ.items()
               if k not in (API_KEY_ENV, CLUSTER_TOKEN_ENV, KV_SECRET_ENV)}
        env.update(secrets.env(spec.role))
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        _normal_priority(spec.name)  # the process inherits our niceness
        self.procs = ProcessSet(log_dir=self.dir)
        self.proc: Proc = self.procs.spawn(spec.name, argv, spec.role, env=env)
        self.pid_file.write_text(json.dumps({"pid": self.proc.popen.pid,
                                             "start": _start_time(self.proc.popen.pid)}))
        self._stopping = False
        threading.Thread(target=self._watch, name="splitserve-watch", daemon=True).start()

    def _kill_previous(self) -> None:
        try:
            old = json.loads(self.pid_file.read_text())
        except (OSError, ValueError):
            return
        pid = old.get("pid")
        if isinstance(pid, int) and old.get("start") and _start_time(pid) == old["start"]:
            log.warning("%s: killing the process a previous incarnation left (pid %d)",
                        self.spec.name, pid)
            try:
                os.killpg(pid, signal.SIGKILL)  # its process group: engines included
            except ProcessLookupError:
                pass
            while _start_time(pid) == old["start"]:
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)

    def _watch(self) -> None:
        code = self.proc.popen.wait()
        if not self._stopping:
            # Not asked to stop: the component crashed or was killed. Exiting the actor is how
            # Ray learns of it and restarts us (a new process, the same worker id).
            log.error("%s exited unexpectedly (exit %s); restarting through Ray",
                      self.spec.name, code)
            self.procs.stop(grace_s=0)  # its engines, if any are left
            os._exit(1)

    def ready(self) -> dict[str, str]:
        """Block until the process serves (a worker: its engine loaded); its endpoints, with
        the node's address in place of a wildcard bind."""
        self.procs.wait_ready([self.proc], self.cfg.start_timeout_s)
        return self._endpoints()

    def info(self) -> dict:
        import warnings

        import ray

        with warnings.catch_warnings():  # deprecated in Ray 2.60, with no replacement yet
            warnings.simplefilter("ignore")
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        return {"name": self.spec.name, "role": self.spec.role and self.spec.role.value,
                "actor_pid": os.getpid(), "pid": self.proc.popen.pid, "node": self.node_ip,
                "endpoints": self._endpoints(),
                "restarted": restarted}

    def _endpoints(self) -> dict[str, str]:
        """Without waiting: {} while the process starts. A restarted actor is never asked
        ready() (its process registers on its own), so this reads the ready file itself."""
        f = self.proc.ready_file
        if not self.proc.endpoints and f.exists() and f.read_text():
            self.proc.endpoints = json.loads(f.read_text())
        return {k: v.replace("0.0.0.0", self.node_ip) for k, v in self.proc.endpoints.items()}

    def drain(self) -> int | None:
        """Stop the process gracefully (SIGTERM, then the kill after the grace period); the
        actor is then ready to be killed. The process's exit code."""
        self._stopping = True
        self.procs.stop(grace_s=self.cfg.drain_timeout_s)
        self.pid_file.unlink(missing_ok=True)
        return self.proc.popen.returncode
