"""`splitserve plan --memory`: KV bytes per token, blocks, context and concurrency from a config.

The engine's own block counts are checked against `plan` where engines run anyway: the e2e
cluster (tests/e2e/test_serving.py, tiny model) and the SmolLM2 engine test (tests/test_smollm2.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.kv_memory import MIB, ModelKvShape, plan
from bench.planner import add_arguments, main


def _config_dir(tmp_path: Path, **cfg) -> Path:
    base = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "hidden_size": 576, "max_position_embeddings": 8192, "dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
    return tmp_path


def test_bytes_per_token_show_gqa_and_fp8(tmp_path: Path) -> None:
    shape = ModelKvShape.from_model_dir(_config_dir(tmp_path))
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (30, 3, 64)  # head = 576 / 9
    # 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes: a third of the 9 query heads' figure.
    assert plan(shape, "float32", 0).bytes_per_token == 30 * 3 * 64 * 2 * 4 == 46_080
    assert plan(shape, "float32", 0, kv_dtype="fp8").bytes_per_token == 46_080 // 4
    assert plan(shape, "bfloat16", 0).bytes_per_token == 46_080 // 2  # auto: the model's dtype
    mha = ModelKvShape.from_model_dir(_config_dir(tmp_path, num_key_value_heads=None))
    assert mha.kv_heads == 9


def test_blocks_context_and_sequences(tmp_path: Path) -> None:
    shape = ModelKvShape.from_model_dir(_config_dir(tmp_path))
    p = plan(shape, "float32", 256 * MIB, block_size=128, context=1000)
    assert p.block_bytes == 46_080 * 128
    assert p.blocks == 256 * MIB // (46_080 * 128) == 45
    assert p.longest_context == 45 * 128  # under the 8,192-token window
    assert p.sequences_at_context == 45 // 8  # 1,000 tokens take 8 blocks each
    big = plan(shape, "float32", 4096 * MIB)
    assert big.longest_context == 8192  # the window caps one sequence
    assert big.sequences_at_context == big.blocks // 64  # default context: the window
    assert plan(shape, "float32", 1 * MIB).blocks == 0


def test_weights_counted_from_safetensors_headers(tiny_model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        want = sum(f.get_tensor(k).numel() for k in f.keys())
    shape = ModelKvShape.from_model_dir(tiny_model_dir)
    assert shape.parameters == want
    assert plan(shape, "float32", 0).weight_bytes == 4 * want


def _cli(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_prints_the_plan(tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(_cli("--memory", str(tiny_model_dir), "--dtype", "float32",
                     "--kv-cache-mib", "128", "--context", "1024")) == 0
    out = capsys.readouterr().out
    assert "2 x 2 x 64 x 2 (K, V) x 4 (float32) = 2,048 B" in out
    assert "= 512 blocks = 65,536 tokens" in out
    assert "sequences at 1,024 tokens of context at once: 64" in out


def test_cli_gpu_sizing_subtracts_weights(tiny_model_dir: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    assert main(_cli("--memory", str(tiny_model_dir), "--device-memory-gib", "1",
                     "--memory-fraction", "0.5", "--reserve-gib", "0.25",
                     "--kv-cache-dtype", "fp8", "--block-size", "16")) == 0
    out = capsys.readouterr().out
    shape = ModelKvShape.from_model_dir(tiny_model_dir)
    weights = plan(shape, "bfloat16", 0).weight_bytes  # the checkpoint's dtype on a GPU
    kv = (1 << 30) // 2 - weights - (1 << 30) // 4
    assert f"= {kv // (shape.bytes_per_token(1) * 16):,} blocks" in out


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-dtype", "int3"], "unknown dtype 'int3'"),
    (["--kv-cache-mib", "8", "--device-memory-gib", "8"], "not both"),
    (["--context", "0"], "must be positive"),
])
def test_cli_bad_input_is_a_clear_error(tiny_model_dir: Path, capsys: pytest.CaptureFixture,
                                        argv: list[str], message: str) -> None:
    assert main(_cli("--memory", str(tiny_model_dir), *argv)) == 2
    assert message in capsys.readouterr().err


def test_cli_without_a_config_is_a_clear_error(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    assert main(_cli("--memory", str(tmp_path))) == 2
    assert "not a Hugging Face model directory (no config.json)" in capsys.readouterr().err


def test_profile_mode_still_needs_rate_and_slo(capsys: pytest.CaptureFixture) -> None:
    assert main(_cli("--profile-json", "p.json")) == 2
    assert "--rate and --slo are required" in capsys.readouterr().err
