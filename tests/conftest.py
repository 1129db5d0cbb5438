"""Shared fixtures: the generated tiny model, and hygiene for tests that start processes."""

from __future__ import annotations

import os
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
