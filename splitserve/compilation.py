"""How an engine runs its model: compiled, as vLLM runs it by default, or eager.

Compiled is the default because it is what users of vLLM run and compare against: on a 2-core
Xeon, plain vLLM's defaults gave 1.3x the tokens per second of `--enforce-eager` per stream and
1.4x its throughput at 32 concurrent requests (docs/benchmarks.md, "Against plain vLLM").

On CPU vLLM compiles the whole forward with Inductor (`DYNAMO_TRACE_ONCE`); attention is an opaque
custom op inside it, so the KV connector's per-layer hooks run as Python on every step, as they do
eagerly. On GPU vLLM adds CUDA graphs; there a *full* graph replays attention without running
Python, so a hook inside attention (the layered load's per-layer wait) would never run: such an
engine uses piecewise graphs, whose splits leave attention outside the graphs
(`graph_overrides`), and an explicit full mode beside a layered load is refused at start-up.

The compile cache: every engine of a host reads and writes the same directories (vLLM's
`VLLM_CACHE_ROOT`, Inductor's `TORCHINDUCTOR_CACHE_DIR`), so only the first start of a model on a
host compiles; later ones load vLLM's AOT-compiled forward (on CPU through `engine_plugin`).
`compile_env` names them when `--compile-cache-dir` is given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from splitserve.lifeline import ENGINE_PARENT_ENV

# CUDA graph modes (vLLM's CUDAGraphMode, lower case); "auto" is ours, see graph_overrides.
GRAPH_MODES = ("auto", "full_and_piecewise", "full_decode_only", "piecewise", "none")
_FULL = ("full_and_piecewise", "full_decode_only")

# vLLM 0.32 on CPU cannot load its own AOT-compiled artifacts: it calls `finalize_loading` on
# the loaded function, which only its GPU backend's functions have, and on the CPU backend's
# (Inductor's, a plain function) that raised, so each start logged "Compiling model again due
# to a load failure ... 'function' object has no attribute 'finalize_loading'" and compiled
# again. `engine_plugin` gives such a function the method, with nothing to do: a warm `up` of
# SmolLM2 (two engines, 2 cores) then took 32 s against 26 s eager; without the AOT cache
# (Dynamo traces again, Inductor's cache answers) 38 s. Loaded as a `vllm.general_plugins`
# entry point (pyproject.toml) in the engines of splitserve's workers on CPU.
_PATCHED = "_splitserve_finalizable"

# vLLM keys its compile cache on every vLLM variable in the environment, the CPU engine's core
# binding among them, so the engines of one host, each on cores of its own (`up` places them
# so), never shared a compiled forward: `up`'s prefill and decode engines each compiled. Where an
# engine runs is not what it compiles (vLLM's CPU Inductor config reads the thread count when it
# runs: `cpp.dynamic_threads`), so `engine_plugin` leaves the binding out of the key.
NOT_COMPILED = ("VLLM_CPU_OMP_THREADS_BIND",)


def check(enforce_eager: bool, cudagraph_mode: str, layered_load: bool) -> None:
    """Refuse, at start-up, a combination that cannot work (ValueError with what to change)."""
    if cudagraph_mode not in GRAPH_MODES:
        raise ValueError(f"cudagraph_mode must be one of {GRAPH_MODES}, got {cudagraph_mode!r}")
    if enforce_eager and cudagraph_mode not in ("auto", "none"):
        raise ValueError(f"--enforce-eager runs no CUDA graphs: drop --cudagraph-mode "
                         f"{cudagraph_mode} or --enforce-eager")
    if layered_load and cudagraph_mode in _FULL:
        raise ValueError(
            f"--kv-load layered waits for each layer inside attention, which a full CUDA graph "
            f"replays without running it: --cudagraph-mode {cudagraph_mode} cannot load "
            f"layered (use --cudagraph-mode piecewise or auto, or another --kv-load)")


def graph_overrides(cudagraph_mode: str, kv_role: str | None, layered_load: bool,
                    max_num_seqs: int, speculative_tokens: int) -> tuple[dict[str, Any], str]:
    """vLLM `compilation_config` entries for a GPU engine, and why, for its log.

    auto: a prefill engine (kv_producer) never runs a decode-only batch, so the full decode
    graphs vLLM captures by default would cost start-up and memory for nothing: piecewise. A
    layered load needs attention outside the graphs: piecewise. A decode engine's batches are at
    most max_num_seqs requests of 1 + speculative_tokens tokens, so its graphs stop there (vLLM's
    own default captures up to twice that, for mixed batches a decode pool does not run).
    Everything else keeps vLLM's defaults."""
    out: dict[str, Any] = {}
    why = []
    mode = cudagraph_mode
    if mode == "auto":
        if kv_role == "kv_producer":
            mode, reason = "piecewise", "a prefill engine runs no decode-only batch"
        elif layered_load:
            mode, reason = "piecewise", "the layered KV load waits inside attention"
        else:
            mode, reason = None, "vLLM's default"
        why.append(f"CUDA graphs {mode or 'full_and_piecewise'} ({reason})")
    else:
        why.append(f"CUDA graphs {mode} (as configured)")
    if mode is not None:
        out["cudagraph_mode"] = mode.upper()
    if kv_role == "kv_consumer" and mode != "none":
        out["max_cudagraph_capture_size"] = max_num_seqs * (1 + speculative_tokens)
        why.append(f"captured up to {out['max_cudagraph_capture_size']} tokens, a decode "
                   f"pool's largest batch")
    return out, "; ".join(why)


def compile_env(cache_dir: str | None) -> dict[str, str]:
    """The environment that points vLLM's and Inductor's compile caches at `cache_dir` (the
    engine's processes inherit it); nothing when it is None (both tools' own defaults, which
    every engine of one user on a host already shares)."""
    if not cache_dir:
        return {}
    root = Path(cache_dir).expanduser()
    return {"VLLM_CACHE_ROOT": str(root), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}


def describe(enforce_eager: bool, gpu: bool, graphs: str, env: Mapping[str, str]) -> str:
    """One line for the engine's log: how its model runs and where its compile cache is."""
    if enforce_eager:
        return "eager (--enforce-eager): no torch.compile, no CUDA graphs"
    # vLLM keeps Inductor's cache of each compiled model under its own root as well.
    cache = env.get("VLLM_CACHE_ROOT") or "~/.cache/vllm"
    what = "torch.compile (Inductor)" + (f", {graphs}" if gpu else "")
    return (f"compiled: {what}; compile cache {cache}, shared by this host's engines (the "
            f"first start of a model compiles, later ones read it)")


def engine_plugin() -> None:
    """vLLM general plugin: on CPU, vLLM's AOT compile cache loads (see `_PATCHED`) and serves
    engines on any cores (see `NOT_COMPILED`)."""
    if ENGINE_PARENT_ENV not in os.environ:
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        finalizable_loads()
        one_key_for_every_core()


def _nothing_to_finalize(vllm_config: Any) -> None:
    return  # Inductor's compiled function is whole once loaded


def finalizable_loads() -> None:
    """Every function torch loads from a compile cache in this process gets a no-op
    `finalize_loading` where it has none (vLLM calls it on whatever it loaded)."""
    import torch.compiler

    load = torch.compiler.load_compiled_function
    if getattr(load, _PATCHED, False):  # plugins load more than once per process
        return

    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        fn = load(*args, **kwargs)
        compiled = getattr(getattr(fn, "_artifacts", None), "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            try:
                compiled.finalize_loading = _nothing_to_finalize
            except AttributeError:
                pass  # not a plain function: vLLM compiles again, and says so
        return fn

    setattr(load_compiled_function, _PATCHED, True)
    load_compiled_function.__wrapped_load__ = load  # type: ignore[attr-defined]
    torch.compiler.load_compiled_function = load_compiled_function


def one_key_for_every_core() -> None:
    """vLLM's compile cache key without the variables in NOT_COMPILED."""
    import vllm.envs as envs

    factors = envs.compile_factors
    if getattr(factors, _PATCHED, False):
        return

    def compile_factors() -> dict[str, object]:
        return {k: v for k, v in factors().items() if k not in NOT_COMPILED}

    setattr(compile_factors, _PATCHED, True)
    compile_factors.__wrapped__ = factors  # type: ignore[attr-defined]
    envs.compile_factors = compile_factors


def aot_loads() -> int:
    """How many compiled forwards this process loaded from vLLM's AOT compile cache."""
    from vllm.compilation.counter import compilation_counter

    return compilation_counter.num_aot_artifacts_loaded
