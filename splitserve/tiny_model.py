"""The generated test model: a Llama-architecture model with random weights, made here.

`write_model(dir, preset, seed)` writes a Hugging Face model directory that vLLM and transformers
both load: config.json, generation_config.json, bf16 safetensors and a locally trained tokenizer.
Same preset and seed, same bytes. `default_model_dir()` generates it once into the cache directory
(models.py, which every `--model` flag goes through, runs `python -m splitserve.tiny_model PRESET`
to do it without loading torch itself).

Weights are drawn with a scale (std = 1/sqrt(fan_in), unit embeddings) that keeps activations
O(1) through the layers, so logits are peaked and attention depends on context: greedy output is
not a near-tie lottery between implementations, and corrupting the KV cache visibly changes it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from splitserve.models import preset_dir
from splitserve.tiny_tokenizer import BOS_TOKEN, EOS_TOKEN, write_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads: grouped-query attention, as in real models
    intermediate_size: int
    vocab_size: int  # requested tokenizer size; the trained one may come out slightly smaller
    max_position_embeddings: int


PRESETS: dict[str, ModelShape] = {
    # Cheap enough for tests: several engines start in seconds and prefill is ~free.
    "tiny": ModelShape(256, 2, 4, 2, 512, 4096, 4096),
    # ~140M parameters: prefill costs what it costs relative to decode on real deployments.
    "bench": ModelShape(1024, 12, 16, 4, 2816, 4096, 4096),
}


def _param_shapes(s: ModelShape, vocab: int) -> dict[str, tuple[int, ...]]:
    head_dim = s.hidden_size // s.num_attention_heads
    kv_dim = s.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, s.hidden_size)}
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (s.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (s.hidden_size, s.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, s.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, s.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (s.hidden_size, s.hidden_size)
        shapes[p + "post_attention_layernorm.weight"] = (s.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (s.intermediate_size, s.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (s.intermediate_size, s.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (s.hidden_size, s.intermediate_size)
    shapes["model.norm.weight"] = (s.hidden_size,)
    shapes["lm_head.weight"] = (vocab, s.hidden_size)
    return shapes


def _init_weights(s: ModelShape, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _param_shapes(s, vocab).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        tensors[name] = t.to(torch.bfloat16).contiguous()
    return tensors


def _hf_config(s: ModelShape, vocab: int, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.hidden_size // s.num_attention_heads,
        "intermediate_size": s.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
    }


def write_model(out_dir: Path | str, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a complete HF model directory for `preset` into `out_dir` (created if missing)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    shape = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out, seed, shape.vocab_size, shape.max_position_embeddings)
    tok = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    bos_id, eos_id = ids[BOS_TOKEN], ids[EOS_TOKEN]
    _write_json(out / "config.json", _hf_config(shape, vocab, bos_id, eos_id))
    _write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    # Metadata holds one key only: safetensors writes a map's keys in hash order, which would
    # break "same seed, same bytes". Preset and seed go to splitserve_model.json instead.
    save_file(_init_weights(shape, vocab, seed), str(out / "model.safetensors"), {"format": "pt"})
    _write_json(out / "splitserve_model.json", {"preset": preset, "seed": seed, **asdict(shape)})
    return out


def default_model_dir(preset: str = "tiny", seed: int = 0) -> Path:
    """The cached model for `preset`, generated on first use.

    Several processes may start at once (a local cluster), so generation happens under a file
    lock into a temp dir that is renamed into place: readers never see a half-written model.
    """
    final = preset_dir(preset, seed)
    root = final.parent
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{preset}-seed{seed}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "config.json").exists():
            log.info("generating the %s model (seed %d) into %s", preset, seed, final)
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{preset}-"))
            try:
                write_model(tmp, preset, seed)
                tmp.rename(final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return final


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":  # models.resolve_model's way to generate without loading torch itself
    print(default_model_dir(*sys.argv[1:2]))
