"""How engines run their model: compiled by default, eager on request, CUDA graphs planned per
role (splitserve/compilation.py). No engine: the GPU plan is checked as vLLM's own config reads
it, which is the CPU dry run of what a GPU host would start with."""

from __future__ import annotations

import pytest

from deploy.cli import build_parser
from splitserve.compilation import check, compile_env, graph_overrides
from splitserve.engine import EngineConfig, engine_args
from splitserve.kv.settings import ConnectorSettings


@pytest.mark.budget(15)  # the first import of vLLM's config in the process
def test_engines_compile_by_default_and_every_launcher_has_enforce_eager() -> None:
    assert EngineConfig(model="m").enforce_eager is False
    parser = build_parser()
    for command in (["prefill"], ["decode"], ["colocated"], ["up"], ["ray", "up"]):
        assert parser.parse_args([*command, "--model", "m"]).enforce_eager is False, command
        a = parser.parse_args([*command, "--model", "m", "--enforce-eager"])
        assert a.enforce_eager is True, command
    # The CPU engine: compiled is vLLM's own default, so nothing is overridden; eager says so.
    assert engine_args(EngineConfig(model="m"), gpu=False).enforce_eager is False
    assert engine_args(EngineConfig(model="m", enforce_eager=True), gpu=False).enforce_eager


def test_up_hands_enforce_eager_to_its_workers() -> None:
    from deploy.launch_flags import UP_DECIDES, WORKER_SIDE, child_argv

    def handed(*flags: str) -> list[str]:
        return child_argv(build_parser().parse_args(["up", "--model", "m", *flags]),
                          WORKER_SIDE, UP_DECIDES)

    assert "--enforce-eager" in handed("--enforce-eager")
    assert "--enforce-eager" not in handed()
    assert handed("--compile-cache-dir", "/c")[-2:] == ["--compile-cache-dir", "/c"]


LAYERED = ConnectorSettings(load="layered")


@pytest.mark.parametrize("mode", ["full_and_piecewise", "full_decode_only"])
def test_a_layered_load_under_full_cuda_graphs_is_refused_at_start_up(mode: str) -> None:
    """A full graph replays attention without running Python, where the layered load waits for
    each layer: the combination would read unfilled KV, so it never starts."""
    with pytest.raises(ValueError, match="layered.*piecewise"):
        EngineConfig(model="m", kv_role="kv_consumer", kv_settings=LAYERED, cudagraph_mode=mode)
    # A producer does not load, and a consumer loading otherwise waits outside the forward.
    EngineConfig(model="m", kv_role="kv_producer", kv_settings=LAYERED, cudagraph_mode=mode)
    EngineConfig(model="m", kv_role="kv_consumer", cudagraph_mode=mode)


def test_contradictions_are_refused() -> None:
    with pytest.raises(ValueError, match="--enforce-eager runs no CUDA graphs"):
        check(True, "piecewise", False)
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        check(False, "fast", False)
    check(True, "auto", False)
    check(True, "none", False)


def test_gpu_graphs_per_role_as_vllm_reads_them() -> None:
    """vLLM's own CompilationConfig takes our overrides (it refuses a mode it does not know)."""
    from vllm.config import CUDAGraphMode

    def plan(**kw):
        return engine_args(EngineConfig(model="m", **kw), gpu=True).compilation_config

    # Prefill: no decode-only batch ever, so no full decode graphs.
    assert plan(kv_role="kv_producer").cudagraph_mode == CUDAGraphMode.PIECEWISE
    # Layered loads: attention outside the graphs; graphs up to the decode pool's batch.
    c = plan(kv_role="kv_consumer", kv_settings=LAYERED, max_num_seqs=32)
    assert c.cudagraph_mode == CUDAGraphMode.PIECEWISE and c.max_cudagraph_capture_size == 32
    # A decode engine keeps vLLM's default mode (None: vLLM picks full+piecewise), with graphs
    # up to its largest batch in tokens.
    d = plan(kv_role="kv_consumer", max_num_seqs=48, speculative_tokens=3)
    assert d.cudagraph_mode is None and d.max_cudagraph_capture_size == 48 * 4
    # Colocated, and every engine on CPU or eager: vLLM's defaults, untouched.
    default = engine_args(EngineConfig(model="m"), gpu=False).compilation_config
    assert plan() == default
    assert plan(kv_role="kv_producer", enforce_eager=True) == default
    assert engine_args(EngineConfig(model="m", kv_role="kv_producer"), gpu=False
                       ).compilation_config == default
    # Explicit: as asked.
    assert plan(cudagraph_mode="none").cudagraph_mode == CUDAGraphMode.NONE
    assert plan(cudagraph_mode="full_decode_only").cudagraph_mode == \
        CUDAGraphMode.FULL_DECODE_ONLY


def test_the_reason_is_said() -> None:
    _, why = graph_overrides("auto", "kv_producer", False, 64, 0)
    assert "piecewise" in why and "prefill" in why
    _, why = graph_overrides("auto", None, False, 64, 0)
    assert "vLLM's default" in why


def test_one_cache_directory_for_vllm_and_inductor(tmp_path) -> None:
    assert compile_env(None) == {}
    env = compile_env(str(tmp_path))
    assert env == {"VLLM_CACHE_ROOT": str(tmp_path),
                   "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}


def test_a_function_loaded_from_the_compile_cache_can_be_finalized(monkeypatch) -> None:
    """vLLM calls finalize_loading on what it loads from its AOT cache; Inductor's CPU function
    has none, so the plugin gives it one that does nothing, and leaves vLLM's own alone."""
    import types

    import torch.compiler

    from splitserve.compilation import finalizable_loads

    def inductor_fn():
        return "forward"

    class VllmFn:
        def finalize_loading(self, vllm_config):
            return "vLLM's"

    loaded = {"cpu": inductor_fn, "gpu": VllmFn()}

    def fake_load(which: str):
        return types.SimpleNamespace(_artifacts=types.SimpleNamespace(compiled_fn=loaded[which]))

    monkeypatch.setattr(torch.compiler, "load_compiled_function", fake_load)
    finalizable_loads()
    finalizable_loads()  # vLLM loads its plugins more than once: one wrapper
    assert torch.compiler.load_compiled_function.__wrapped_load__ is fake_load
    cpu = torch.compiler.load_compiled_function("cpu")._artifacts.compiled_fn
    assert cpu.finalize_loading(None) is None and cpu() == "forward"
    gpu = torch.compiler.load_compiled_function("gpu")._artifacts.compiled_fn
    assert gpu.finalize_loading(None) == "vLLM's"


def test_the_compile_cache_key_leaves_out_where_an_engine_runs(monkeypatch) -> None:
    """Engines on different cores share one compiled forward (vLLM's key has the binding)."""
    import vllm.envs as envs

    from splitserve.compilation import one_key_for_every_core

    # vLLM's own function (this process may have loaded the plugin with an engine already).
    vllms = getattr(envs.compile_factors, "__wrapped__", envs.compile_factors)
    monkeypatch.setattr(envs, "compile_factors", vllms)  # the plugin's again after the test
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert envs.compile_factors()["VLLM_CPU_OMP_THREADS_BIND"] == "1"  # vLLM's own key
    one_key_for_every_core()
    factors = envs.compile_factors()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in factors and "VLLM_USE_AOT_COMPILE" in factors
