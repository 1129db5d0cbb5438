"""Last e2e module (files run in name order): it takes worker D1 away for good."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest

from tests.e2e.cluster import ProcCluster
from tests.e2e.conftest import wait_models
from tests.e2e.test_serving import _request, _stream
from tests.utils import make_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("leak_check")]


def test_sigkill_idle_worker_is_dropped(cl: ProcCluster, tiny_model_dir: Path) -> None:
    cl.by_name["D1"].kill()
    wait_models(cl, "A", prefill=2, decode=1)  # after the heartbeat timeout
    stub = cl.generation(cl.by_name["A"])
    prompts = make_prompts(tiny_model_dir, [40] * 8, seed=16)
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _stream(stub, _request(p, max_tokens=8))[0], prompts))
    assert all(len(g) >= 1 for g in got)
