"""Which model directory a `--model` value means, without loading torch.

`resolve_model(None | "tiny" | "bench" | DIR)`: the generated embedded models live in a cache
directory (`SPLITSERVE_CACHE_DIR`, else `~/.cache/splitserve`); the first use generates one in a
child process (tiny_model.py needs torch, and the router process must never load it), any other
value must be a Hugging Face model directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PRESETS = ("tiny", "bench")  # tiny_model.PRESETS holds their shapes


def cache_root() -> Path:
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitserve"


def preset_dir(preset: str, seed: int = 0) -> Path:
    """Where the generated `preset` model lives (it may not exist yet)."""
    return cache_root() / "models" / f"{preset}-seed{seed}"


def resolve_model(model: str | None) -> str:
    """A `--model` value: None or a preset name → the generated model; else a local dir."""
    if model is None or model in PRESETS:
        preset = model or "tiny"
        path = preset_dir(preset)
        if not (path / "config.json").exists():
            # Generation holds a file lock, so processes racing here generate it once.
            subprocess.run([sys.executable, "-m", "splitserve.tiny_model", preset], check=True)
        return str(path)
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ValueError(f"--model {model!r}: not a Hugging Face model directory (no config.json)")
    return str(path)
