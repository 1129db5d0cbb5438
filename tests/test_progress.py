"""`up`'s progress lines: the phase a starting engine is in, read from its log as it grows."""

from __future__ import annotations

from pathlib import Path

from deploy.progress import LogWatch, phase

LOAD = "(Worker pid=1) INFO 12-07 23:58:20 [cpu_model_runner.py:68] Starting to load model m...\n"
COMPILE = ("(Worker pid=1) INFO 12-07 23:58:20 [cpu_model_runner.py:87] Warming up model for "
           "the compilation...\n")


def test_the_last_marker_names_the_phase() -> None:
    assert phase("INFO starting\n") is None
    assert phase(LOAD) == "loading the model"
    assert phase(LOAD + COMPILE).startswith("compiling the model")
    assert phase(LOAD + COMPILE + "... Capturing CUDA graphs (mixed prefill-decode)\n") == \
        "capturing CUDA graphs"


def test_a_watch_says_each_phase_once_and_waits_for_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "decode-1.log"
    w = LogWatch(log)
    assert w.changed() is None  # no log yet
    log.write_text(LOAD)
    assert w.changed() == "loading the model"
    assert w.changed() is None  # said once
    with open(log, "a") as f:
        f.write(COMPILE[:30])  # a line half written: not read yet
    assert w.changed() is None
    with open(log, "a") as f:
        f.write(COMPILE[30:] + "INFO another line\n")
    assert w.changed().startswith("compiling the model")
    assert w.changed() is None
