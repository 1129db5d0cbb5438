"""A Kubernetes rollout on one host: rendered manifests in, local processes out, no API server.

What it keeps of Kubernetes (the parts a rollout's convergence depends on):
  pods      each Deployment replica runs its container's command and args exactly as rendered,
            with its env resolved as the kubelet does (value, secretKeyRef — a missing Secret
            or key fails the pod — fieldRef status.podIP / metadata.name) and `$(VAR)`
            expanded. Every pod has an IP of its own, 127.0.1.N (all of 127/8 is loopback):
            binding 0.0.0.0 in a pod binds its own address only, so 0.0.0.0 in args reads as
            the pod IP — the network namespace, reduced to an address.
  services  a ClusterIP 127.0.2.N per Service, a TCP proxy per port that sends each new
            connection to a pod the selector matches *and whose readiness probe passes* —
            unless the Service publishes not-ready addresses. Service names in args, env and
            mounted ConfigMaps (`name`, `name.ns.svc`, `name.ns.svc.cluster.local`) resolve to
            the ClusterIP.
  volumes   a PersistentVolumeClaim is a host directory given to the sim; a ConfigMap is its
            data written to files, as the kubelet projects it; an emptyDir is a directory of
            the pod's own.
  probes    startup, then readiness and liveness, run as the kubelet runs them: gRPC health
            Check (service "" unless named) to podIP:port, HTTP GET (2xx/3xx), TCP connect;
            ports by number or by the container port's name. Periods are capped at 1 s: the
            question is whether the rollout converges, not how fast.
Left out: scheduling and resources (GPU limits are ignored), restarts, DNS beyond Service
names, NetworkPolicy. Worker containers may run a stand-in without an engine
(tests/k8s/standin_worker.py) that speaks the same health and registration protocol.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.credentials import API_KEY_ENV, CLUSTER_TOKEN_ENV, KV_SECRET_ENV
from splitserve.lifeline import PARENT_ENV

WORKER_COMMANDS = {"prefill", "decode", "colocated"}


class NotConverged(AssertionError):
    pass


@dataclass
class Pod:
    name: str
    labels: dict[str, str]
    ip: str
    container: dict
    ports: dict[str, int] = field(default_factory=dict)  # container port name -> number
    volumes: list[dict] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    log: Path | None = None
    started: bool = False  # startup probe passed (or none)
    ready: bool = False
    alive: bool = False  # last liveness result

    def port(self, p: int | str) -> int:
        return self.ports[p] if isinstance(p, str) else int(p)


@dataclass
class Service:
    name: str
    selector: dict[str, str]
    ports: list[dict]
    publish_not_ready: bool
    ip: str


class Cluster:
    def __init__(self, docs: list[dict], secrets: dict[str, dict[str, str]], workdir: Path,
                 env: dict[str, str] | None = None, standin_workers: bool = True,
                 claims: dict[str, Path] | None = None) -> None:
        """`claims`: a host directory for each PersistentVolumeClaim the pods mount."""
        self.docs, self.secrets, self.dir = docs, secrets, workdir
        self.claims = claims or {}
        self.base_env = {k: v for k, v in (env or os.environ).items()
                         if k not in (API_KEY_ENV, CLUSTER_TOKEN_ENV, KV_SECRET_ENV)}
        self.standin = standin_workers
        ips = (f"127.0.2.{i}" for i in itertools.count(1))
        self.services = [Service(d["metadata"]["name"], d["spec"].get("selector", {}),
                                 d["spec"]["ports"], d["spec"].get("publishNotReadyAddresses",
                                                                   False), next(ips))
                         for d in docs if d["kind"] == "Service"]
        pod_ips = (f"127.0.1.{i}" for i in itertools.count(1))
        self.pods: list[Pod] = []
        for d in docs:
            if d["kind"] != "Deployment":
                continue
            tmpl = d["spec"]["template"]
            (c,) = tmpl["spec"]["containers"]  # one container per pod in these manifests
            for i in range(d["spec"].get("replicas", 1)):
                self.pods.append(Pod(f"{d['metadata']['name']}-{i}", tmpl["metadata"]["labels"],
                                     next(pod_ips), c, {p["name"]: p["containerPort"]
                                                        for p in c.get("ports", [])},
                                     tmpl["spec"].get("volumes", [])))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._servers: list[asyncio.base_events.Server] = []
        self.turned_away = 0  # connections a Service rejected: it had no endpoint

    # -- pods --------------------------------------------------------------------------------
    def _resolve_names(self, s: str) -> str:
        for svc in self.services:
            s = re.sub(rf"(?<![\w.-]){re.escape(svc.name)}(\.[\w-]+\.svc(\.cluster\.local)?)?"
                       rf"(?=[:/]|$)", svc.ip, s)
        return s

    def _env(self, pod: Pod) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in pod.container.get("env", []):
            if "value" in e:
                v = _expand(e["value"], env)
            elif "secretKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["secretKeyRef"]
                secret = self.secrets.get(ref["name"], {})
                if ref["key"] not in secret:
                    if ref.get("optional"):
                        continue
                    raise NotConverged(f"{pod.name}: CreateContainerConfigError: secret "
                                       f"{ref['name']!r} has no key {ref['key']!r}")
                v = secret[ref["key"]]
            elif "fieldRef" in e.get("valueFrom", {}):
                v = {"status.podIP": pod.ip, "metadata.name": pod.name,
                     "metadata.namespace": "default"}[e["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                raise NotImplementedError(f"env source of {e}")
            env[e["name"]] = self._resolve_names(v)
        return env

    def argv(self, pod: Pod) -> list[str]:
        env = self._env(pod)
        args = [self._resolve_names(_expand(a, env)) for a in pod.container.get("args", [])]
        args = [pod.ip if a == "0.0.0.0" else a for a in args]  # the pod's own address
        args = [self._mounted(pod, a) for a in args]
        cmd = pod.container["command"]
        assert cmd == ["splitserve"], f"{pod.name}: unknown command {cmd}"
        if self.standin and args and args[0] in WORKER_COMMANDS:
            return [sys.executable, "-m", "tests.k8s.standin_worker", *args]
        return [str(Path(sys.executable).with_name("splitserve")), *args]

    def _mounted(self, pod: Pod, arg: str) -> str:
        """A path under a volume mount → the claim's host directory, or a ConfigMap's files: a
        bind mount, reduced to the paths a command line names."""
        volumes = {v["name"]: v for v in pod.volumes}
        for m in pod.container.get("volumeMounts", []):
            root = m["mountPath"].rstrip("/")
            if (arg == root or arg.startswith(root + "/")) and "configMap" in volumes[m["name"]]:
                return str(self._config_map(pod, volumes[m["name"]]["configMap"]["name"])
                           ) + arg[len(root):]
            if (arg == root or arg.startswith(root + "/")) and "emptyDir" in volumes[m["name"]]:
                return str(self.dir / "emptydir" / pod.name / m["name"]) + arg[len(root):]
            if arg == root or arg.startswith(root + "/"):
                claim = volumes[m["name"]]["persistentVolumeClaim"]["claimName"]
                if claim not in self.claims:
                    raise NotConverged(f"{pod.name}: PersistentVolumeClaim {claim!r} unbound")
                return str(self.claims[claim]) + arg[len(root):]
        return arg

    def _config_map(self, pod: Pod, name: str) -> Path:
        """The ConfigMap's files as `pod` sees them: Service names resolved, and paths under
        the pod's claim mounts (a model's directory) moved to the claims' host directories."""
        (data,) = [d.get("data", {}) for d in self.docs
                   if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
        out = self.dir / "configmaps" / pod.name / name
        out.mkdir(parents=True, exist_ok=True)
        for key, text in data.items():
            text = "\n".join(" ".join(self._mounted(pod, w) for w in line.split(" "))
                              for line in self._resolve_names(text).splitlines())
            (out / key).write_text(text + "\n")
        return out

    def start(self) -> None:
        # Every pod's env and command first: a pod that cannot start fails the rollout before
        # any process runs (the kubelet would leave it in CreateContainerConfigError).
        plan = [(pod, self.argv(pod), {**self.base_env, **self._env(pod),
                                        PARENT_ENV: str(os.getpid())}) for pod in self.pods]
        self._thread.start()
        for svc in self.services:
            for p in svc.ports:
                self._call(self._listen(svc, p))
        for pod, argv, env in plan:
            pod.log = self.dir / f"{pod.name}.log"
            with open(pod.log, "w") as out:
                pod.proc = subprocess.Popen(argv, env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.loop.call_soon_threadsafe(lambda: [self.loop.create_task(self._probe(p))
                                                for p in self.pods])

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    # -- services ----------------------------------------------------------------------------
    def endpoints(self, svc: Service) -> list[Pod]:
        return [p for p in self.pods if svc.selector.items() <= p.labels.items()
                and (p.ready or svc.publish_not_ready) and p.proc and p.proc.poll() is None]

    async def _listen(self, svc: Service, port: dict) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            pods = self.endpoints(svc)
            if not pods:  # no endpoint: kube-proxy rejects the connection
                self.turned_away += 1
                writer.close()
                return
            pod = pods[hash(writer.get_extra_info("peername")) % len(pods)]
            try:
                r2, w2 = await asyncio.open_connection(pod.ip, pod.port(port["targetPort"]))
            except OSError:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, w2), _pipe(r2, writer))

        self._servers.append(await asyncio.start_server(handle, svc.ip, port["port"]))

    # -- probes ------------------------------------------------------------------------------
    async def _check(self, pod: Pod, probe: dict) -> bool:
        timeout = probe.get("timeoutSeconds", 1) * 5  # a busy test host answers slowly
        try:
            if "grpc" in probe:
                g = probe["grpc"]
                async with grpc.aio.insecure_channel(f"{pod.ip}:{pod.port(g['port'])}") as ch:
                    r = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=g.get("service", "")),
                        timeout=timeout)
                return r.status == health_pb2.HealthCheckResponse.SERVING
            if "httpGet" in probe:
                h = probe["httpGet"]
                url = f"http://{pod.ip}:{pod.port(h['port'])}{h.get('path', '/')}"
                code = await asyncio.to_thread(_http_status, url, timeout)
                return 200 <= code < 400
            if "tcpSocket" in probe:
                _, w = await asyncio.wait_for(asyncio.open_connection(
                    pod.ip, pod.port(probe["tcpSocket"]["port"])), timeout)
                w.close()
                return True
        except (grpc.RpcError, OSError, asyncio.TimeoutError):
            return False
        raise NotImplementedError(f"probe {probe}")

    async def _probe(self, pod: Pod) -> None:
        c = pod.container
        startup, ready, live = (c.get(k) for k in ("startupProbe", "readinessProbe",
                                                   "livenessProbe"))
        while pod.proc.poll() is None:
            if not pod.started:
                pod.started = startup is None or await self._check(pod, startup)
            if pod.started:
                pod.ready = ready is None or await self._check(pod, ready)
                pod.alive = live is None or await self._check(pod, live)
            await asyncio.sleep(min((startup if not pod.started else ready or {}).get(
                "periodSeconds", 10), 1.0))
        pod.ready = pod.alive = False

    # -- the rollout -------------------------------------------------------------------------
    def report(self) -> str:
        return "; ".join(f"{p.name} ({p.ip}): " + ("exited " + str(p.proc.returncode)
                                                   if p.proc.poll() is not None else
                                                   "ready" if p.ready else "alive, not ready"
                                                   if p.alive else "not started")
                         for p in self.pods)

    def wait_converged(self, timeout_s: float = 300.0, stuck_after: int = 3) -> None:
        """Until every pod is ready. Fails when a pod exits, when time runs out (a hang guard),
        or when it is stuck: every other pod ready, the rest alive but not ready, and since then
        the Services have turned away `stuck_after` connections for want of a ready endpoint
        (the pods keep asking, with backoff, and nothing that could make a pod ready gets
        through: a retry can only meet the same empty Service). A rollout that converges turns
        none away in that state. Counted, not timed: the retries' backoff sets the pace."""
        deadline, stuck_at = time.monotonic() + timeout_s, None
        while not all(p.ready for p in self.pods):
            dead = [p for p in self.pods if p.proc.poll() is not None]
            if dead:
                raise NotConverged(f"{dead[0].name} exited: {self.report()}\n"
                                   f"{dead[0].log.read_text()[-2000:]}")
            waiting = [p for p in self.pods if not p.ready]
            if all(p.alive for p in waiting):
                stuck_at = self.turned_away if stuck_at is None else stuck_at
                if self.turned_away - stuck_at >= stuck_after:
                    raise NotConverged(f"stuck: {stuck_after} connections turned away by "
                                       f"Services without a ready endpoint: {self.report()}")
            else:
                stuck_at = None
            if time.monotonic() > deadline:
                raise NotConverged(f"not ready after {timeout_s:.0f} s: {self.report()}")
            time.sleep(0.2)

    def service_address(self, name: str, port: str) -> str:
        (svc,) = [s for s in self.services if s.name == name]
        (p,) = [p for p in svc.ports if p["name"] == port]
        return f"{svc.ip}:{p['port']}"

    def stop(self) -> None:
        """SIGTERM every pod, its grace period (capped at 10 s), then SIGKILL its session."""
        for p in self.pods:
            if p.proc and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.pods:
            if p.proc is None:
                continue
            try:
                p.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.proc.wait()
        if self._thread.is_alive():
            async def close() -> None:
                for s in self._servers:
                    s.close()
                for t in asyncio.all_tasks():
                    if t is not asyncio.current_task():
                        t.cancel()

            self._call(close())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def _expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known variables only, $$ escapes."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), s)


def _http_status(url: str, timeout: float) -> int:
    try:
        return urllib.request.urlopen(url, timeout=timeout).status
    except urllib.error.HTTPError as e:
        return e.code


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        w.close()
