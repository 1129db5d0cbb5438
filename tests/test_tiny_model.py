"""The embedded default model: deterministic bytes, loadable by transformers, sane tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from splitserve import models
from splitserve.models import resolve_model
from splitserve.tiny_model import PRESETS, default_model_dir, write_model


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = write_model(tmp_path / "again", "tiny", seed=0)
    assert _files(again) == _files(tiny_model_dir)


def test_other_seed_other_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    other = write_model(tmp_path / "other", "tiny", seed=1)
    assert _files(other)["model.safetensors"] != _files(tiny_model_dir)["model.safetensors"]


def test_directory_is_a_complete_hf_llama(tiny_model_dir: Path) -> None:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert cfg["num_hidden_layers"] >= 2 and cfg["hidden_size"] >= 256
    tok_cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["bos_token"] and tok_cfg["eos_token"] and "{%" in tok_cfg["chat_template"]
    for name in ("generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (tiny_model_dir / name).is_file()


def test_transformers_loads_weights_and_tokenizer(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert next(model.parameters()).dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("hello")["input_ids"]
    assert ids[0] == tok.bos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("### assistant:\n") and "hi" in chat


@pytest.mark.parametrize("text", ["plain ascii", "café naïve", "日本語 🚀 👍🏽",
                                  "def f(x):\n  return 1"])
def test_tokenizer_round_trips_any_text(tiny_model_dir: Path, text: str) -> None:
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    enc = tok.encode(text)
    assert enc.ids[0] == tok.token_to_id("<|bos|>")
    assert tok.decode(enc.ids, skip_special_tokens=True) == text


def test_default_model_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    first = default_model_dir("tiny")
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir("tiny") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert resolve_model("tiny") == str(first)
    assert not list(first.parent.glob(".tmp-*"))  # no temp dirs left behind


def test_resolve_model_generates_a_missing_preset_in_a_child(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """The router resolves its model too, and must not load torch doing it."""
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    path = Path(resolve_model("tiny"))
    assert path == models.preset_dir("tiny") and (path / "model.safetensors").exists()


def test_preset_names_agree() -> None:
    assert set(models.PRESETS) == set(PRESETS)


def test_resolve_model_rejects_non_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_bench_preset_is_about_150m_parameters() -> None:
    s = PRESETS["bench"]
    per_layer = 2 * s.hidden_size**2 + 2 * s.hidden_size * (
        s.num_key_value_heads * s.hidden_size // s.num_attention_heads
    ) + 3 * s.hidden_size * s.intermediate_size
    total = s.num_hidden_layers * per_layer + 2 * s.vocab_size * s.hidden_size
    assert 120e6 < total < 180e6
