"""Deployment manifests, validated offline: every overlay renders with kustomize and every
built-in resource validates against the Kubernetes API schemas (kubernetes-validate, strict:
unknown fields fail); every container runs a real CLI command; probes, Services, HPAs, PDBs and
the PodMonitor point at things that exist; secrets are required. (That the rollout converges
is tests/k8s/test_rollout.py.) The CRDs (PodMonitor, RayCluster, RayJob) have no schema
offline: their fields are checked here by hand."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deploy.cli import build_parser
from splitserve.settings import parse_args

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy/k8s"
OVERLAYS = ["overlays/cpu-demo", "overlays/gpu"]
K8S_VERSION = "1.33.0"  # a version current clusters run; the schemas ship with the package
CRDS = {"PodMonitor", "RayCluster", "RayJob"}


def render(path: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / path)], capture_output=True,
                         text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _containers(d: dict) -> list[dict]:
    return d["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("path", [*OVERLAYS, "kuberay"])
def test_every_rendered_resource_validates_against_the_api_schemas(path: str) -> None:
    docs = render(path)
    assert docs
    for d in docs:
        if d["kind"] in CRDS:
            continue
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_schema_validation_catches_a_wrong_field() -> None:
    (dep,) = [d for d in render("overlays/cpu-demo") if d["metadata"]["name"]
              == "splitserve-router" and d["kind"] == "Deployment"]
    _containers(dep)[0]["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def _parse(c: dict, d: dict, configs: dict[str, dict], tmp: Path):
    """The container's command line as `splitserve` reads it, its --config file from the
    ConfigMap that the path names, through the pod's volume."""
    volumes = {v["name"]: v for v in d["spec"]["template"]["spec"].get("volumes", [])}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
    args = [a.replace("$(POD_IP)", "10.0.0.1") for a in c["args"]]
    for i, a in enumerate(args):
        for root, volume in mounts.items():
            if a.startswith(root + "/") and "configMap" in volume:
                local = tmp / volume["configMap"]["name"] / a[len(root) + 1:]
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_text(configs[volume["configMap"]["name"]][a[len(root) + 1:]])
                args[i] = str(local)
    return parse_args(build_parser(), args)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_kinds_and_wiring(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Deployment"] * 3 + ["Service"] * 2 + ["PodDisruptionBudget"] * 2
                           + ["HorizontalPodAutoscaler"] * 2 + ["PodMonitor", "ConfigMap"])
    configs = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    registry = by[("Service", "splitserve-registry")]
    assert registry["spec"]["publishNotReadyAddresses"] is True  # workers reach a router
    assert not by[("Service", "splitserve-router")]["spec"].get("publishNotReadyAddresses")
    pods = {n: d for (k, n), d in by.items() if k == "Deployment"}
    for d in pods.values():
        (c,) = _containers(d)
        assert c["command"] == ["splitserve"]
        args = _parse(c, d, configs, tmp_path)
        assert "--config" in c["args"]  # every component reads the shared settings file
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        grpc_port = args.port
        assert ports["grpc"] == grpc_port == c["readinessProbe"]["grpc"]["port"]
        secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]
                   if "secretKeyRef" in e.get("valueFrom", {})}
        # Required, not optional: a pod without its credentials must not start open.
        assert secrets and all(not ref.get("optional", False) for ref in secrets.values())
        assert "SPLITSERVE_CLUSTER_TOKEN" in secrets
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"][
            "metadata"]["labels"].items()
        if args.command == "router":
            assert ports["cluster"] == args.cluster_port == registry["spec"]["ports"][0]["port"]
            assert ports["http"] == args.http_port
            assert "SPLITSERVE_API_KEY" in secrets and "SPLITSERVE_KV_SECRET" not in secrets
            # Liveness must not wait for workers (/health and gRPC health do).
            assert c["livenessProbe"]["httpGet"]["path"] == "/metrics"
        else:
            assert args.router == f"splitserve-registry:{args.router.split(':')[1]}"
            assert ports["metrics"] == args.metrics_port
            assert args.advertise_host == args.kv_host == "10.0.0.1"
            assert "SPLITSERVE_KV_SECRET" in secrets and "SPLITSERVE_API_KEY" not in secrets
            assert c["startupProbe"]["grpc"]["port"] == grpc_port
    models = {_parse(_containers(d)[0], d, configs, tmp_path).model for d in pods.values()}
    assert models == ({"/models/model"} if overlay.endswith("gpu") else {"tiny"})
    gpu = [_containers(d)[0]["resources"].get("limits", {}).get("nvidia.com/gpu")
           for n, d in pods.items() if n != "splitserve-router"]
    assert gpu == ([1, 1] if overlay.endswith("gpu") else [None, None])
    for kind in ("HorizontalPodAutoscaler", "PodDisruptionBudget"):
        for (k, n), d in by.items():
            if k != kind:
                continue
            target = pods[n]  # one per pool, named as its Deployment
            if kind == "HorizontalPodAutoscaler":
                assert d["spec"]["scaleTargetRef"]["name"] == n
                assert d["spec"]["metrics"][0]["pods"]["metric"]["name"].startswith("splitserve_")
            else:
                assert d["spec"]["selector"]["matchLabels"].items() <= target["spec"][
                    "template"]["metadata"]["labels"].items()
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    names = {p["name"] for d in pods.values() for p in _containers(d)[0]["ports"]}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= names


def test_hpa_metrics_are_what_the_adapter_exposes_and_workers_serve() -> None:
    rules = yaml.safe_load((K8S / "prometheus-adapter/rules.yaml").read_text())["rules"]["custom"]
    exposed = {r["seriesQuery"].split('"')[1].replace("splitserve:", "splitserve_")
               for r in rules}
    wanted = {d["spec"]["metrics"][0]["pods"]["metric"]["name"]
              for d in render("overlays/cpu-demo") if d["kind"] == "HorizontalPodAutoscaler"}
    assert wanted == exposed
    served = (ROOT / "splitserve/worker/metrics.py").read_text()
    assert all(f'"{m.replace("splitserve_", "splitserve:")}"' in served for m in wanted)


def test_kuberay_job_runs_a_real_ray_command(tmp_path: Path) -> None:
    """The RayJob's command, with the settings file its head pod mounts from the ConfigMap."""
    docs = {d["kind"]: d for d in render("kuberay")}
    cmd = docs["RayJob"]["spec"]["entrypoint"].split()
    assert cmd[:3] == ["splitserve", "ray", "up"]
    head_pod = {"spec": docs["RayCluster"]["spec"]["headGroupSpec"]}
    head = _containers(head_pod)[0]
    configs = {docs["ConfigMap"]["metadata"]["name"]: docs["ConfigMap"]["data"]}
    args = _parse({**head, "args": cmd[1:]}, head_pod, configs, tmp_path)
    assert args.detach and args.address == "auto" and args.gpus_per_worker == 1
    assert (args.model, args.kv_cache_mib) == ("/models/model", 16384)
    secrets = {e["name"] for e in head["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert secrets == {"SPLITSERVE_API_KEY", "SPLITSERVE_CLUSTER_TOKEN", "SPLITSERVE_KV_SECRET"}
    assert docs["RayCluster"]["spec"]["rayVersion"] == __import__("ray").__version__
