"""The layers hold: the core imports nothing above it, and the router process never loads torch.

  bench/                          load tests and planning: may import anything but tests/
  deploy/                         composition: may import anything below bench/ (bench/ adds its
                                  subcommands through an entry point, bench/commands.py)
  router/, prefill_worker/,       the components: import only the core (and not each other)
  decode_worker/
  splitserve/                     the core: imports none of the above
Checked statically on every import statement (function-level ones included), and at run time on
a real `splitserve router` process that served requests.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from splitserve.faults import Faults
from splitserve.v1 import generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
ABOVE_CORE = {"router", "prefill_worker", "decode_worker", "deploy", "bench", "tests"}
FORBIDDEN = {
    "splitserve": ABOVE_CORE | {"ray"},  # Ray is a way to deploy: deploy/ray/ alone uses it
    "router": ABOVE_CORE - {"router"} | {"torch", "vllm", "transformers", "ray"},
    "prefill_worker": ABOVE_CORE - {"prefill_worker"},
    "decode_worker": ABOVE_CORE - {"decode_worker"},
    "deploy": {"bench", "tests"},
    "bench": {"tests"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_above_it(package: str) -> None:
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        hits = _imports(path) & FORBIDDEN[package]
        if hits:
            bad[str(path.relative_to(ROOT))] = sorted(hits)
    assert not bad, f"{package}/ imports what sits above it: {bad}"


def test_the_layering_check_sees_function_level_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from router.flow import run_flow\n    import torch.nn\n")
    assert _imports(f) == {"router", "torch"}


def test_router_process_never_loads_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real `splitserve router` serves gRPC and HTTP requests (with no workers: UNAVAILABLE and
    503 after validation, tokenisation and routing ran), then reports at exit what it loaded."""
    modules, ready = tmp_path / "modules.json", tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "router", "--model", str(tiny_model_dir),
         "--grpc-port", "0", "--http-port", "0", "--ready-file", str(ready)], cwd=ROOT,
        env={**os.environ, **Faults(modules_file=str(modules)).to_env()}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text()):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "router not ready"
            time.sleep(0.1)
        endpoints = json.loads(ready.read_text())
        with grpc.insecure_channel(endpoints["grpc"]) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            assert stub.Tokenize(generation_pb2.TokenizeRequest(text="hello"), timeout=10).token_ids
            with pytest.raises(grpc.RpcError) as e:
                stub.Complete(generation_pb2.GenerateRequest(text="hello"), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        http = endpoints["http"]
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]})):
            req = urllib.request.Request(http + path, json.dumps(body).encode(),
                                         {"content-type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 503
        assert urllib.request.urlopen(http + "/metrics", timeout=10).status == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    loaded = set(json.loads(modules.read_text()))
    assert "router.generation" in loaded  # the report is real
    heavy = sorted(m for m in loaded if m.split(".")[0] in {"torch", "vllm", "transformers"})
    assert not heavy, f"the router process loaded {heavy[:10]}"
