"""Streams beside other work on the host: a client in a session of its own, sharing it with a CPU
hog (about a third of a core, not pinned), as a load tool and a sidecar on a real host would.

The bounds are relative, from the same run: the median first token at most 1.5x the same
client's alone (prompts of the same length, never cached); the longest gap between two events
of any stream at most 20x the median gap (after the hand-off's; 4x failed a clean-clone CI run
at 53 ms against a 9.6 ms median, while the stall it catches is 1-2 s, over 100x). With
vLLM's own one-second spin of its engines' queue readers (`--spin-s 1`,
splitserve/engine_spin.py) both cores stay busy with yields that only the cluster's own session
gets, and such a client read each stream's tokens all at once, 1-2 s late: both bounds fail.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import ROOT, ProcCluster
from tests.utils import make_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leak_check")]
STREAMS = 10
PROMPT = 200  # tokens: past the first KV block, so the prefill and the hand-off do real work
OUT = 32
# Tokens per event: the tiny model's step is ~4 ms, within reach of one scheduler time slice on
# a 2-core host running six engines; four steps an event make a gap the bound can measure (a
# stall is hundreds of them).
STREAM_INTERVAL = 4


def _client(url: str, model: str, prompts: list[list[int]], hog: bool) -> dict:
    """tests/e2e/busy_client.py in a session of its own (killed with its session if it hangs)."""
    p = subprocess.run([sys.executable, "-m", "tests.e2e.busy_client", url, model, str(OUT),
                        "--stream-interval", str(STREAM_INTERVAL), *(["--hog"] if hog else [])],
                       input=json.dumps(prompts), cwd=ROOT,
                       capture_output=True, text=True, timeout=300, start_new_session=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("router", ["B", "R"])  # 1P1D, colocated
def test_streams_beside_a_cpu_hog_neither_stall_nor_slow_down(cl: ProcCluster,
                                                               tiny_model_dir: Path,
                                                               router: str) -> None:
    url, model = cl.by_name[router].endpoints["http"], Path(cl.model).name
    seed = 7 if router == "B" else 8
    warm, alone, busy = (make_prompts(tiny_model_dir, [PROMPT] * STREAMS, seed=seed * 10 + k)
                         for k in range(3))
    _client(url, model, warm[:2], hog=False)  # the first requests on a path pay one-off costs
    first_alone = _client(url, model, alone, hog=False)["firsts"]
    busy_run = _client(url, model, busy, hog=True)
    assert busy_run["hog_ran"]
    first_busy, gaps = busy_run["firsts"], busy_run["gaps"]
    ratio = statistics.median(first_busy) / statistics.median(first_alone)
    longest, median = max(gaps), statistics.median(gaps)
    report = (f"first token {1e3 * statistics.median(first_alone):.0f} ms alone, "
              f"{1e3 * statistics.median(first_busy):.0f} ms beside the hog; gaps median "
              f"{1e3 * median:.1f} ms, longest {1e3 * longest:.1f} ms")
    print(f"[{router}] {report}")
    assert ratio <= 1.5, report
    assert longest <= 20 * median, report
