"""`splitserve ray up|scale|status|down`: a deployment on a Ray cluster, from the shell.

  up      join the cluster at --address (none: start a local one), deploy, print the router's
          address on stdout; then wait and stop everything on Ctrl-C — or, with --detach, leave
          the deployment running (its controller is a detached actor) and return.
  scale   --prefill N --decode M: new workers register before removed ones drain.
  status  the deployment as JSON (actors, processes, endpoints, scaling events).
  down    drain and stop the deployment.
Flags become a RayConfig (config.py) here and nowhere else: the components' settings are the
flags `up` takes too (deploy/launch_flags.py), handed on as argv made from the same schema;
secrets come from the environment or files, never flags.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from deploy import security_flags as sec
from deploy.launch_flags import (
    RAY_DECIDES,
    ROUTER_SIDE,
    WORKER_SIDE,
    add_component_flags,
    child_argv,
)
from splitserve.settings import add_config_flag


def add_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("ray", help="a deployment on a Ray cluster (up, scale, status, down)")
    rs = r.add_subparsers(dest="ray_command", required=True)

    u = rs.add_parser("up", help="deploy router + pools as Ray actors")
    add_config_flag(u)
    _common(u, address_default=None)
    u.add_argument("--model", default="tiny",
                   help="HF model directory present on every node, or 'tiny'/'bench' (each "
                        "node generates the same bytes)")
    u.add_argument("--prefill", type=int, default=1)
    u.add_argument("--decode", type=int, default=1)
    res = u.add_argument_group("resources and placement")
    res.add_argument("--cpus-per-worker", type=float, default=1.0,
                     help="Ray CPUs of each worker actor; CPU engines pin this many cores")
    res.add_argument("--gpus-per-worker", type=float, default=0.0,
                     help="GPUs of each worker actor (GPU clusters; 0: CPU engines)")
    res.add_argument("--router-cpus", type=float, default=1.0)
    res.add_argument("--placement", default="SPREAD",
                     choices=["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"],
                     help="placement-group strategy of each pool")
    res.add_argument("--max-restarts", type=int, default=5,
                     help="times a dead component actor is restarted")
    net = u.add_argument_group("network")
    net.add_argument("--host", default=None,
                     help="bind and advertise this address (default: all interfaces, each "
                          "node's IP advertised)")
    net.add_argument("--grpc-port", type=int, default=50051)
    net.add_argument("--cluster-port", type=int, default=50052, help="the router's Registry")
    net.add_argument("--http-port", type=int, default=8000)
    sec.add_api_key(u)
    a = u.add_argument_group("autoscaling (docs/deploy.md)")
    a.add_argument("--autoscale", action="store_true",
                   help="grow and shrink each pool from the router's metrics against the SLO")
    a.add_argument("--slo", default="ttft=1s,tpot=100ms",
                   help="p90 targets, each with its unit, ms or s (with --autoscale)")
    for pool in ("prefill", "decode"):
        a.add_argument(f"--min-{pool}", type=int, default=1)
        a.add_argument(f"--max-{pool}", type=int, default=4)
    a.add_argument("--cooldown-s", type=float, default=60.0)
    a.add_argument("--autoscale-interval-s", type=float, default=10.0)
    a.add_argument("--plan-from", nargs="+", default=None, metavar="RESULT_JSON",
                   help="bench result files (as `splitserve plan` reads): pools stay at least "
                        "as large as the planner's model needs for the observed rate")
    u.add_argument("--detach", action="store_true",
                   help="return once up; the deployment stays (needs --address)")
    add_component_flags(u, decides=RAY_DECIDES)  # after Ray's own: theirs name the ports
    u.set_defaults(func=_up)

    s = rs.add_parser("scale", help="resize the pools of a running deployment")
    _common(s)
    s.add_argument("--prefill", type=int, default=None)
    s.add_argument("--decode", type=int, default=None)
    s.set_defaults(func=_scale)

    st = rs.add_parser("status", help="the deployment as JSON")
    _common(st)
    st.set_defaults(func=_status)

    d = rs.add_parser("down", help="drain and stop a deployment")
    _common(d)
    d.set_defaults(func=_down)


def _common(p: argparse.ArgumentParser, address_default: str | None = "auto") -> None:
    p.add_argument("--address", default=address_default,
                   help="the Ray cluster (`ray start --head` prints it; 'auto': the one on "
                        "this host)" + ("; default: start a local one" if address_default is None
                                        else ""))
    p.add_argument("--name", default="splitserve", help="the deployment's name")


def _config_options(a: argparse.Namespace) -> dict:
    return dict(name=a.name, engine_args=tuple(child_argv(a, WORKER_SIDE, RAY_DECIDES)),
                host=a.host, grpc_port=a.grpc_port,
                cluster_port=a.cluster_port, http_port=a.http_port,
                cpus_per_worker=a.cpus_per_worker, gpus_per_worker=a.gpus_per_worker,
                router_cpus=a.router_cpus, max_restarts=a.max_restarts, placement=a.placement,
                router_args=tuple(child_argv(a, ROUTER_SIDE, RAY_DECIDES)))


def _autoscale_of(a: argparse.Namespace):
    if not a.autoscale:
        return None
    from deploy.ray.config import AutoscaleConfig
    from splitserve.slo import SLO

    slo = SLO.parse(a.slo)
    if slo.ttft_s is None or slo.tpot_s is None:
        raise ValueError("--autoscale needs --slo with both ttft and tpot")
    profile = None
    if a.plan_from:
        from splitserve.planner import load_profile_from_results

        profile = load_profile_from_results(a.plan_from).to_dict()
    return AutoscaleConfig(min_prefill=a.min_prefill, max_prefill=a.max_prefill,
                           min_decode=a.min_decode, max_decode=a.max_decode,
                           ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s,
                           cooldown_s=a.cooldown_s, interval_s=a.autoscale_interval_s,
                           profile=profile)


def _up(a: argparse.Namespace) -> int:
    from deploy.ray.api import deploy

    if a.detach and a.address is None:
        raise ValueError("--detach needs --address: a local cluster started here ends with "
                         "this command (start one with `ray start --head`)")
    d = deploy(a.model, a.prefill, a.decode, address=a.address, detached=a.detach,
               api_keys=sec.api_keys_of(a), autoscale=_autoscale_of(a), **_config_options(a))
    import ray

    print(f"[splitserve] ray: deployment {d.name!r} up on the Ray cluster at "
          f"{ray.get_runtime_context().gcs_address}. gRPC: {d.address}  HTTP (OpenAI API): "
          f"{d.http}/v1  metrics: {d.http}/metrics\n[splitserve] try: splitserve generate "
          f"\"Hello\" --router {d.address}", file=sys.stderr, flush=True)
    print(d.address, flush=True)  # stdout: the one thing scripts need
    if a.detach:
        return 0

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    print("[splitserve] ray: stopping ...", file=sys.stderr, flush=True)
    d.shutdown()
    return 0


def _scale(a: argparse.Namespace) -> int:
    from deploy.ray.api import connect

    if a.prefill is None and a.decode is None:
        raise ValueError("say --prefill N and/or --decode M")
    sizes = {k: len(v) for k, v in connect(a.name, a.address).scale(a.prefill, a.decode)[
        "pools"].items()}
    print(json.dumps(sizes))
    return 0


def _status(a: argparse.Namespace) -> int:
    from deploy.ray.api import connect

    print(json.dumps(connect(a.name, a.address).status(), indent=2))
    return 0


def _down(a: argparse.Namespace) -> int:
    from deploy.ray.api import connect

    connect(a.name, a.address).shutdown()
    print(f"[splitserve] ray: deployment {a.name!r} stopped", file=sys.stderr)
    return 0
