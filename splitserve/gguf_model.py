"""GGUF file → Hugging Face model directory (config, safetensors, tokenizer, chat template).

`convert(gguf_path, out_dir)` writes what vLLM, transformers and the router load like any other
checkpoint: config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and chat_template.jinja.

The weights are stored in float32 by default because that is lossless: every dequantized GGUF
value (a 4- or 8-bit integer times an fp16 scale, plus an fp16 offset) is exact in float32 but not
in bfloat16, and rounding them to bf16 changed the greedy answer to one of six test prompts.
The engine still runs in whatever `--dtype` asks (bf16 by default); vLLM casts at load time.

transformers does the reading: its GGUF support builds the config and a fast tokenizer from the
GGUF metadata, and `load_gguf_checkpoint` dequantizes every tensor under its Hugging Face name.
That matters for Llama q/k projections, which llama.cpp stores with the rotary permutation
reversed; transformers undoes it (tests/test_smollm2.py checks the tensors against the `gguf`
package's own dequantization with the permutation undone independently). transformers will not
`save_pretrained` a GGUF-loaded model, so we load the tensors into no model at all (the skeleton
on the meta device only names the parameters) and write them ourselves.

Needs torch, transformers and gguf: run it in a child process where the caller must not load
torch (splitserve/fetch.py is that process).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Files transformers' tokenizer writes that say where it was loaded from, not what it is.
_LOCAL_KEYS = ("is_local", "local_files_only", "_commit_hash")


def convert(gguf_path: Path, out: Path, dtype: str = "float32",
            progress: Callable[[str], None] = log.info, show_bar: bool = False) -> None:
    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    transformers.utils.logging.set_verbosity_error()  # its notes on GGUF keys it skips
    if not show_bar:  # its tensor loop calls tqdm directly, past transformers' own switch;
        # a bar redrawn with \r is noise in a log file
        gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    out.mkdir(parents=True, exist_ok=True)
    src, name = str(gguf_path.parent), gguf_path.name

    progress("reading the GGUF metadata (config, tokenizer, chat template)")
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    with torch.device("meta"):  # names and shapes only, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)

    progress(f"dequantizing {name} to {dtype}")
    tensors = gguf_utils.load_gguf_checkpoint(str(gguf_path), return_tensors=True,
                                   model_to_load=skeleton)["tensors"]
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # the embedding, shared
    if set(tensors) != expected:
        raise RuntimeError(f"GGUF tensors do not match the {type(skeleton).__name__} "
                           f"parameters: missing {sorted(expected - set(tensors))[:5]}, "
                           f"extra {sorted(set(tensors) - expected)[:5]}")
    weights = {k: v.to(DTYPES[dtype]).contiguous() for k, v in sorted(tensors.items())}
    save_file(weights, str(out / "model.safetensors"), {"format": "pt"})

    progress("writing the tokenizer and config")
    tokenizer.save_pretrained(out)
    _clean_tokenizer_config(out / "tokenizer_config.json", config.max_position_embeddings)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    # config.json last: models.resolve_model takes its presence to mean "complete".
    config.architectures = [type(skeleton).__name__]  # vLLM picks its model class by this
    config.dtype = dtype
    cfg = config.to_diff_dict()  # what differs from LlamaConfig's defaults, as HF writes it
    cfg.pop("_model_name_or_path", None)  # GGUF's general.name, not a path
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _clean_tokenizer_config(path: Path, max_len: int) -> None:
    cfg = json.loads(path.read_text())
    for k in _LOCAL_KEYS:
        cfg.pop(k, None)
    cfg["model_max_length"] = max_len  # the GGUF's context length, not transformers' 1e30
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
