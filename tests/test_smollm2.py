"""The real default model: its conversion from GGUF is exact, and vLLM serves it as transformers
runs the GGUF.

The converter (splitserve/gguf_model.py) reads through transformers' GGUF support. These tests
read the same file with the `gguf` package alone — our own name map and our own undoing of
llama.cpp's rotary permutation of q/k — so the two implementations check each other. The
conversion stores float32, in which every dequantized value is exact: equality is exact too.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.kv_memory import MIB, ModelKvShape, plan
from tests.conftest import PackagedModelFiles
from tests.utils import EAGER, chat_prompts, engine_greedy, hf_greedy_ids

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Give me three tips for staying healthy.", "What is 2 + 2?",
             "Name the largest planet in the solar system.",
             "Explain what a CPU does in one sentence."]
MAX_TOKENS = 48

_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader, key: str):
    return reader.fields[key].contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` (rows regrouped for its rotary layout)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


@pytest.fixture(scope="module")
def gguf_weights(smollm2: PackagedModelFiles) -> dict[str, torch.Tensor]:
    """Every GGUF tensor dequantized by the `gguf` package, under its Hugging Face name."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(smollm2.gguf)
    heads = {"attn_q": _field(reader, "llama.attention.head_count"),
             "attn_k": _field(reader, "llama.attention.head_count_kv")}
    out = {}
    for t in reader.tensors:
        stem, kind = t.name.rsplit(".", 1)
        w = dequantize(t.data, t.tensor_type)  # numpy order: [rows, cols] = HF's [out, in]
        if stem.startswith("blk."):
            _, layer, part = stem.split(".")
            if part in heads:
                w = _unpermute(w, heads[part])
            name = f"model.layers.{layer}.{_LAYER[part]}.{kind}"
        else:
            name = f"{_TOP[stem]}.{kind}"
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
    return out


def test_converted_tensors_equal_the_dequantized_gguf(
        smollm2: PackagedModelFiles, gguf_weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    converted = load_file(smollm2.model_dir / "model.safetensors")
    assert set(converted) == set(gguf_weights)  # no lm_head on either side: it is tied
    for name, want in gguf_weights.items():
        assert converted[name].dtype == torch.float32, name
        assert torch.equal(converted[name], want), name


def test_converted_config_and_tokenizer_match_the_gguf_metadata(
        smollm2: PackagedModelFiles) -> None:
    from gguf import GGUFReader

    r = GGUFReader(smollm2.gguf)
    cfg = json.loads((smollm2.model_dir / "config.json").read_text())
    expect = {"num_hidden_layers": "llama.block_count", "hidden_size": "llama.embedding_length",
              "intermediate_size": "llama.feed_forward_length",
              "num_attention_heads": "llama.attention.head_count",
              "num_key_value_heads": "llama.attention.head_count_kv",
              "max_position_embeddings": "llama.context_length",
              "vocab_size": "llama.vocab_size", "bos_token_id": "tokenizer.ggml.bos_token_id",
              "eos_token_id": "tokenizer.ggml.eos_token_id"}
    for ours, theirs in expect.items():
        assert cfg[ours] == _field(r, theirs), ours
    assert cfg["rope_parameters"]["rope_theta"] == pytest.approx(
        _field(r, "llama.rope.freq_base"))
    assert cfg["rms_norm_eps"] == pytest.approx(_field(r, "llama.attention.layer_norm_rms_epsilon"))
    assert cfg["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float32"

    tok = json.loads((smollm2.model_dir / "tokenizer.json").read_text())
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert tok["model"]["vocab"] == {t: i for i, t in enumerate(tokens)}
    assert [" ".join(m) for m in tok["model"]["merges"]] == _field(r, "tokenizer.ggml.merges")
    template = (smollm2.model_dir / "chat_template.jinja").read_text()
    assert template == _field(r, "tokenizer.chat_template")
    tok_cfg = json.loads((smollm2.model_dir / "tokenizer_config.json").read_text())
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    assert tok_cfg["eos_token"] == tokens[eos] == "<|im_end|>"  # chat turns end generation


@pytest.mark.slow
@pytest.mark.budget(90)  # an engine of its own and transformers on a 135M model
def test_vllm_greedy_on_the_conversion_equals_transformers_on_the_gguf(
        smollm2: PackagedModelFiles, gguf_weights: dict[str, torch.Tensor]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from splitserve.engine import EngineConfig, running_engine

    # transformers' own reading of the GGUF's config, with the weights dequantized above.
    config = AutoConfig.from_pretrained(smollm2.gguf.parent, gguf_file=smollm2.gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(gguf_weights, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    model.tie_weights()
    prompts = chat_prompts(smollm2.model_dir, QUESTIONS)
    expected = hf_greedy_ids(model, prompts, MAX_TOKENS)

    cfg = EngineConfig(model=str(smollm2.model_dir), dtype="float32", **EAGER)
    blocks: list[int] = []

    async def run() -> list[list[int]]:
        with running_engine(cfg) as e:
            blocks.append(e.vllm_config.cache_config.num_gpu_blocks)
            return await engine_greedy(e, prompts, MAX_TOKENS)

    got = asyncio.run(run())
    # `splitserve plan --memory` predicts the engine's own KV capacity for a real GQA model.
    shape = ModelKvShape.from_model_dir(smollm2.model_dir)
    assert blocks == [plan(shape, "float32", cfg.kv_cache_mib * MIB, block_size=cfg.block_size)
                      .blocks]
    for q, want, have in zip(QUESTIONS, expected, got):
        assert have == want, f"{q!r}: vLLM {have} != transformers {want}"
    # A real model answers: the first question's answer names the city.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(smollm2.model_dir) / "tokenizer.json"))
    assert "Paris" in tok.decode(got[0])
