"""The rollout of the rendered manifests, simulated on this host (tests/k8s/sim.py): the first
manifest (tests/k8s/old-splitserve.yaml, as it was on main) deadlocks — workers register
through a Service that routes only to a ready router, and the router is ready only once a
worker registered — and every overlay of deploy/k8s converges and serves a request through the
router's Service. Workers are engine-less stand-ins speaking the real health and registration
protocol; the router is the real process, run exactly as its container says."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
import yaml

from splitserve.credentials import bearer
from splitserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.k8s.sim import Cluster, NotConverged

# Not engines, but a real router process per rollout (seconds to start on a busy host).
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SECRET = {"splitserve": {"api-key": "client-key", "cluster-token": "cluster-token-123",
                         "kv-secret": "kv-secret-456"}}


def render(overlay: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy/k8s" / overlay)],
                         capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _old() -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "tests/k8s/old-splitserve.yaml").read_text())
            if d]


@pytest.fixture
def env(tmp_path: Path, tiny_model_dir: Path) -> dict[str, str]:
    """`--model tiny` in a container generates the model; here it is already in the cache."""
    import os

    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "tiny-seed0").symlink_to(tiny_model_dir)
    return {**os.environ, "SPLITSERVE_CACHE_DIR": str(cache)}


def _rollout(docs: list[dict], tmp_path: Path, env: dict[str, str], secrets=SECRET) -> Cluster:
    # The gpu overlay's model volume: a claim holding the tiny model as `model`.
    models = tmp_path / "pvc-models"
    models.mkdir()
    (models / "model").symlink_to(Path(env["SPLITSERVE_CACHE_DIR"]) / "models/tiny-seed0")
    c = Cluster(docs, secrets, tmp_path, env, claims={"splitserve-models": models})
    c.start()
    return c


def test_the_first_manifest_never_becomes_ready(tmp_path: Path, env) -> None:
    c = _rollout(_old(), tmp_path, env)
    try:
        with pytest.raises(NotConverged, match="stuck") as e:
            c.wait_converged()
        report = str(e.value)
        assert "splitserve-router-0 (127.0.1.1): alive, not ready" in report
        assert "splitserve-prefill-0 (127.0.1.2): ready" in report
        assert "splitserve-decode-0 (127.0.1.3): ready" in report
    finally:
        c.stop()


@pytest.mark.parametrize("overlay", ["overlays/cpu-demo", "overlays/gpu"])
def test_every_overlay_converges_and_serves(overlay: str, tmp_path: Path, env) -> None:
    c = _rollout(render(overlay), tmp_path, env)
    try:
        c.wait_converged()
        with grpc.insecure_channel(c.service_address("splitserve-router", "grpc")) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            md = bearer(SECRET["splitserve"]["api-key"])
            (m,) = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10,
                                   metadata=md).models
            assert (m.prefill_workers, m.decode_workers) == (1, 1)
            req = generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]), local_prefill=True,
                sampling=common_pb2.SamplingParams(max_tokens=4))
            got = [t for chunk in stub.Generate(req, timeout=30, metadata=md)
                   for t in chunk.token_ids]
            assert len(got) == 4
    finally:
        c.stop()


def test_a_missing_secret_key_keeps_the_pods_from_starting(tmp_path: Path, env) -> None:
    secrets = {"splitserve": {k: v for k, v in SECRET["splitserve"].items() if k != "kv-secret"}}
    c = Cluster(render("overlays/cpu-demo"), secrets, tmp_path, env)
    try:
        with pytest.raises(NotConverged, match="no key 'kv-secret'"):
            c.start()
        assert all(p.proc is None for p in c.pods)
    finally:
        c.stop()
