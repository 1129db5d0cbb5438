"""A real local Ray cluster (CPU, started here in a temp dir of its own) running a real
deployment of the tiny model; the tests share one deployment, each sizing it as it needs
(file order makes each resize the previous test's), so any one of them also runs alone:

  1P1D: greedy output of disaggregated requests (KV moved between the Ray workers' engines)
        equals the decode engine prefilling itself — the colocated computation;
  scale 1P1D -> 1P2D with `splitserve ray scale` (another driver) under load: no failed request
        (one pool grows: each engine start costs minutes on a slow 2-core CI host);
  kill a decode worker actor under load: Ray restarts it, the new process registers under the
        same worker id and serves, and every request finishes (the router migrates the dead
        worker's requests);
  scale 1P2D -> 1P1D with the Python API under load: no failed request;
  down: workers idle with every KV block free first, then no actor, no process left;
  the CLI: `ray up --autoscale --detach`, `ray status`, `ray down` on a deployment of its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.procs import live_groups
from router.registry import worker_stub
from splitserve import scrape
from splitserve.credentials import bearer
from splitserve.procstat import proc_stat
from splitserve.roles import Role
from splitserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2
from tests.utils import EAGER_FLAG, make_prompts

LENGTHS = [1, 17, 127, 128, 129, 300]
MAX_TOKENS = 10
TOKEN = secrets.token_hex(16)
# An engine started beside two busy ones on two cores took >600 s to load here (2026-12-03),
# while each component had a session of its own; in one session it took ~60 s (deploy/procs.py,
# docs/deploy.md). Every wait for an engine start below is this one, the deployment's default;
# pytest's own limit sits above it, so a slow start fails with its own message, not a timeout.
START_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(START_S + 400)]


def _request(ids: list[int], local: bool = False) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids), local_prefill=local,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


def _tokens(stub, req) -> list[int]:
    return [t for chunk in stub.Generate(req, timeout=120) for t in chunk.token_ids]


class Load:
    """Clients sending the prompts in a loop until stopped; each answer is checked against the
    reference, each failure kept."""

    def __init__(self, address: str, prompts: list[list[int]], want: list[list[int]],
                 clients: int = 4) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.prompts, self.want = prompts, want
        self.stop = threading.Event()
        self.ok, self.failures = 0, []
        self.pool = cf.ThreadPoolExecutor(clients)
        self.futures = [self.pool.submit(self._client, i) for i in range(clients)]

    def _client(self, i: int) -> None:
        n = i
        while not self.stop.is_set():
            k = n % len(self.prompts)
            try:
                got = _tokens(self.stub, _request(self.prompts[k]))
                if got == self.want[k]:
                    self.ok += 1
                else:
                    self.failures.append(f"prompt {k}: {got} != {self.want[k]}")
            except grpc.RpcError as e:
                self.failures.append(f"prompt {k}: {e.code().name} {e.details()}")
            n += 1

    def wait_for(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        start = self.ok
        while self.ok < start + n:
            assert time.monotonic() < deadline, f"load stalled: {self.failures[-3:]}"
            time.sleep(0.1)

    def finish(self) -> tuple[int, list[str]]:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=180)
        self.pool.shutdown()
        self.channel.close()
        return self.ok, self.failures


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray cluster of our own: its files in a temp dir, token auth on with a token
    that lives only in this environment (nothing written under ~/.ray)."""
    tmp = tmp_path_factory.mktemp("ray")
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "SPLITSERVE_CLUSTER_TOKEN": TOKEN,  # the deployment's credential: we call workers
           "RAY_USAGE_STATS_ENABLED": "0", "TMPDIR": str(tmp),  # TMPDIR: components' pid files
           "RAY_worker_niceness": "0"}  # as `splitserve ray up` starts its local cluster
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # Ray read its auth mode when it was imported; re-read it as ray.init itself does when it
    # turns token auth on (ray/_private/authentication/authentication_token_setup.py).
    from ray._raylet import Config

    Config.initialize("")
    try:
        # Logical CPUs: one per actor; the engines pin real cores of their own.
        ray.init(_temp_dir=str(tmp / "r"), num_cpus=8, include_dashboard=False,
                 log_to_driver=False)
        yield tmp
    finally:
        ray.shutdown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        Config.initialize("")


@pytest.fixture(scope="module")
def dep(ray_cluster, tiny_model_dir: Path):
    import deploy.ray as ssray

    d = ssray.deploy(str(tiny_model_dir), prefill=1, decode=1, host="127.0.0.1",
                     grpc_port=0, cluster_port=0, http_port=0,  # each bound by its server
                     engine_args=("--dtype", "float32", "--kv-cache-mib", "64", EAGER_FLAG,
                                  "--kv-timeout-s", "5"),
                     start_timeout_s=START_S)
    d.seen = []  # every process that was part of the deployment, checked after `down`
    try:
        yield d
    finally:
        if not getattr(d, "down", False):
            d.shutdown()


@pytest.fixture(scope="module")
def reference(dep, tiny_model_dir: Path):
    """Prompts and their greedy completions computed by the decode engine alone."""
    prompts = make_prompts(tiny_model_dir, LENGTHS, seed=7)
    with grpc.insecure_channel(dep.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        want = [_tokens(stub, _request(p, local=True)) for p in prompts]
    return prompts, want


def _remote_prefills(dep) -> float:
    return scrape.by_label(scrape.fetch(dep.http + "/metrics"),
                           "splitserve:routing_decisions_total", "prefill").get("remote", 0.0)


def _models(dep) -> tuple[int, int]:
    with grpc.insecure_channel(dep.address) as ch:
        (m,) = generation_pb2_grpc.GenerationStub(ch).ListModels(
            generation_pb2.ListModelsRequest(), timeout=10).models
    return m.prefill_workers, m.decode_workers


def _remember(dep) -> dict:
    st = dep.status()
    for info in [st["router_info"], *st["pools"]["prefill"], *st["pools"]["decode"]]:
        dep.seen.append((info["actor_pid"], info["pid"]))
    return st


def test_1p1d_greedy_equals_the_engine_alone(dep, reference) -> None:
    prompts, want = reference
    remote = _remote_prefills(dep)
    with grpc.insecure_channel(dep.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: _tokens(stub, _request(p)), prompts))
    for n, g, w in zip(LENGTHS, got, want):
        assert g == w, f"{n}-token prompt on Ray: {g} != {w}"
    # The disaggregated path really ran: the router sent each prompt to the prefill worker.
    assert _remote_prefills(dep) - remote == len(prompts)
    st = _remember(dep)
    assert [p["name"] for p in st["pools"]["prefill"]] == [f"{dep.name}-prefill-0"]
    assert _models(dep) == (1, 1)


def test_scale_up_from_another_driver_under_load(dep, reference) -> None:
    _sized(dep, 1, 1)
    load = Load(dep.address, *reference)
    load.wait_for(4)
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "ray", "scale", "--address",
                          ray.get_runtime_context().gcs_address, "--name", dep.name,
                          "--prefill", "1", "--decode", "2"],
                         capture_output=True, text=True, timeout=START_S + 300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"prefill": 1, "decode": 2}
    load.wait_for(8)
    ok, failures = load.finish()
    assert not failures, failures
    assert _models(dep) == (1, 2)
    _remember(dep)


def _sized(dep, prefill: int, decode: int) -> None:
    """The deployment at this size (in file order the test before left it so; alone, this
    makes it so)."""
    if dep.sizes() != {"prefill": prefill, "decode": decode}:
        dep.scale(prefill=prefill, decode=decode)
    assert _models(dep) == (prefill, decode)


def test_killed_worker_actor_restarts_and_registers_again(dep, reference) -> None:
    _sized(dep, 1, 2)
    victim = f"{dep.name}-decode-1"
    actor = ray.get_actor(victim, namespace="splitserve")
    before = ray.get(actor.info.remote())
    load = Load(dep.address, *reference)
    load.wait_for(4)
    ray.kill(actor, no_restart=False)  # what a crash of the actor's process looks like
    deadline = time.monotonic() + START_S
    while True:  # the same named actor, a new process, serving again
        try:
            after = ray.get(actor.info.remote(), timeout=10)
            if after["pid"] != before["pid"] and _serving(after["endpoints"]["grpc"]):
                break
        except (ray.exceptions.RayError, grpc.RpcError, KeyError):
            pass
        assert time.monotonic() < deadline, "the killed actor did not come back"
        time.sleep(1)
    assert after["restarted"] and after["actor_pid"] != before["actor_pid"]
    assert after["pid"] != before["pid"]
    assert before["pid"] not in live_groups()  # the old process went with its actor
    load.wait_for(8)
    ok, failures = load.finish()
    assert not failures, failures
    # Registered again: the router lists two decode workers and the new one takes requests.
    assert _models(dep) == (1, 2)
    served = _served(after)
    with grpc.insecure_channel(dep.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for _ in range(40):
            _tokens(stub, _request(reference[0][1]))
            if _served(after) > served:
                break
    assert _served(after) > served, "the restarted worker was never sent a request"
    _remember(dep)


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return r.status == health_pb2.HealthCheckResponse.SERVING


def _served(info: dict) -> float:
    """Requests the worker's engine finished (vLLM's own counter on its metrics port)."""
    return scrape.total(scrape.fetch(info["endpoints"]["metrics"]), "vllm:request_success_total")


def test_scale_down_with_the_python_api_under_load(dep, reference) -> None:
    _sized(dep, 1, 2)
    gone = [ray.get_actor(f"{dep.name}-decode-1", namespace="splitserve")]
    load = Load(dep.address, *reference)
    load.wait_for(4)
    st = dep.scale(prefill=1, decode=1)
    load.wait_for(4)
    ok, failures = load.finish()
    assert not failures, failures
    assert {r: len(v) for r, v in st["pools"].items()} == {"prefill": 1, "decode": 1}
    assert _models(dep) == (1, 1)
    for a in gone:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.info.remote(), timeout=30)


def test_down_leaves_no_actor_process_or_kv_block(dep) -> None:
    st = _remember(dep)
    for info in st["pools"]["prefill"] + st["pools"]["decode"]:
        role = Role(info["role"])
        with grpc.insecure_channel(info["endpoints"]["grpc"]) as ch:
            deadline = time.monotonic() + 30
            while True:
                load = worker_stub(role, ch).Stats(worker_pb2.StatsRequest(), timeout=5,
                                                   metadata=bearer(TOKEN)).load
                if (load.running == load.waiting == load.queue_len == 0
                        and load.free_kv_blocks == load.total_kv_blocks
                        and load.held_kv_blocks == load.held_kv_transfers == 0):
                    break
                assert time.monotonic() < deadline, f"{info['name']} not idle: {load}"
                time.sleep(0.2)
    dep.shutdown()
    dep.down = True
    # Every actor of a deployment is named (the controller, each component); Ray lists the
    # named actors that are alive from its control store (the state API needs the dashboard).
    alive = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "splitserve"]
    assert not alive, alive
    deadline = time.monotonic() + 30
    while True:  # Ray reaps killed actors' processes in its own time
        pids = {p for pair in dep.seen for p in pair}
        left = sorted(p for p in pids if (st := proc_stat(p)) is not None and st.alive)
        left += sorted({pid for _, pid in dep.seen} & live_groups())  # engines too
        if not left:
            break
        assert time.monotonic() < deadline, f"processes left behind: {left}"
        time.sleep(0.5)


def _cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", "ray", *args, "--address",
                           ray.get_runtime_context().gcs_address], capture_output=True,
                          text=True, timeout=timeout_s)


def test_cli_up_with_autoscale_status_and_down(ray_cluster, reference,
                                               tiny_model_dir: Path) -> None:
    """`splitserve ray up --autoscale --detach`, `status` and `down` as a user runs them, on a
    deployment of their own (one colocated-serving decode worker, bounds that hold it there):
    it serves, the autoscaler has looked at its metrics, and `down` leaves no actor."""
    prompts, want = reference
    up = _cli("up", "--detach", "--name", "cli", "--model", str(tiny_model_dir), "--host",
              "127.0.0.1", "--grpc-port", "0", "--cluster-port", "0", "--http-port", "0",
              "--prefill", "0", "--decode", "1", "--dtype", "float32", "--kv-cache-mib", "64",
              EAGER_FLAG, "--autoscale", "--slo", "ttft=60s,tpot=60s", "--min-prefill", "0",
              "--max-prefill", "0", "--max-decode", "1", "--autoscale-interval-s", "0.2",
              timeout_s=START_S + 120)
    assert up.returncode == 0, up.stderr[-3000:]
    address = up.stdout.strip().splitlines()[-1]  # stdout: the router's gRPC address
    try:
        with grpc.insecure_channel(address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            for ids, w in zip(prompts[:3], want[:3]):
                assert _tokens(stub, _request(ids)) == w
        import deploy.ray as ssray

        handle, deadline = ssray.connect("cli"), time.monotonic() + 60
        while handle.status()["autoscale"]["signals"] is None:  # two samples make a window
            assert time.monotonic() < deadline, handle.status()["autoscale"]
            time.sleep(0.2)
        out = _cli("status", "--name", "cli")
        assert out.returncode == 0, out.stderr[-3000:]
        st = json.loads(out.stdout)
        assert st["router"]["grpc"] == address
        assert [len(st["pools"][r]) for r in ("prefill", "decode")] == [0, 1]
        assert st["autoscale"]["ticks"] >= 2 and st["autoscale"]["signals"]["rate"] >= 0
    finally:
        down = _cli("down", "--name", "cli")
    assert down.returncode == 0, down.stderr[-3000:]
    left = [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "splitserve" and a["name"].startswith("cli")]
    assert not left, left
