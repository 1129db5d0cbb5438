"""`--dtype auto`: what a host runs fastest, decided from the CPU's flags (no engine needed)."""

from __future__ import annotations

import pytest

from splitserve.engine import concrete_dtype

AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


@pytest.mark.parametrize(("cpuinfo", "want"), [(AMX, "bfloat16"), (AVX2, "float32"),
                                               ("", "float32")])
def test_auto_follows_native_bf16(cpuinfo: str, want: str) -> None:
    dtype, why = concrete_dtype("auto", cpuinfo)
    assert dtype == want
    assert ("natively" in why) == (want == "bfloat16")


def test_an_explicit_dtype_is_kept() -> None:
    assert concrete_dtype("float16", AVX2) == ("float16", "as configured")
    assert concrete_dtype("bfloat16", AVX2)[0] == "bfloat16"


def test_auto_is_float32_for_a_checkpoint_stored_in_float32(tmp_path) -> None:
    """The default model (SmolLM2 dequantized from 4 bits) is stored in float32: in bf16 vLLM's
    CPU kernels garble its answers, so even a native-bf16 host runs it in float32."""
    import json

    assert concrete_dtype("auto", AMX, str(tmp_path))[0] == "bfloat16"  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert concrete_dtype("auto", AMX, str(tmp_path))[0] == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert concrete_dtype("auto", AMX, str(tmp_path)) == (
        "float32", "the checkpoint is stored in float32")
    assert concrete_dtype("bfloat16", AMX, str(tmp_path))[0] == "bfloat16"  # asked for


def test_our_kv_cache_size_wins_over_vllms_environment() -> None:
    """vLLM's CPU platform takes VLLM_CPU_KVCACHE_SPACE over an explicit KV cache size: the
    variable is taken out of the environment the engine inherits, and the log names both."""
    from splitserve.engine import EngineConfig, claim_environment

    cfg = EngineConfig(model="m", kv_cache_mib=96)
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "PATH": "/bin"}
    (said,) = claim_environment(cfg, env)
    assert env == {"PATH": "/bin"}
    assert "VLLM_CPU_KVCACHE_SPACE=4" in said and "kv_cache_mib=96" in said
    assert claim_environment(cfg, {"VLLM_CPU_KVCACHE_SPACE": ""}) == []  # unset as vLLM reads it
