"""Deployment manifests, validated offline: every container runs a real CLI command, probes and
services point at ports that exist, selectors match."""

from __future__ import annotations

from pathlib import Path

import yaml

from deploy.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _docs() -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/splitserve.yaml").read_text()) if d]


def test_manifest_kinds() -> None:
    kinds = sorted(d["kind"] for d in _docs())
    assert kinds == ["Deployment", "Deployment", "Deployment", "PodMonitor", "Service"]


def test_every_container_command_parses_with_the_cli() -> None:
    router_cluster_port = 50052  # the router's --cluster-port (checked on the router below)
    for d in _docs():
        if d["kind"] != "Deployment":
            continue
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert c["command"] == ["splitserve"]
        args = build_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.1") for a in c["args"]])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        grpc_port = args.grpc_port if args.command == "router" else args.port
        assert ports["grpc"] == grpc_port
        assert c["readinessProbe"]["grpc"]["port"] == grpc_port
        secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]
                   if "secretKeyRef" in e.get("valueFrom", {})}
        # Required, not optional: a pod without its credentials must not start open.
        assert all(not ref.get("optional", False) for ref in secrets.values())
        assert "SPLITSERVE_CLUSTER_TOKEN" in secrets
        if args.command != "router":
            assert ports["metrics"] == args.metrics_port
            assert args.advertise_host == "10.0.0.1" and args.kv_host == "10.0.0.1"
            host, port = args.router.split(":")
            assert host == "splitserve-router" and int(port) == router_cluster_port
            assert "SPLITSERVE_KV_SECRET" in secrets and "SPLITSERVE_API_KEY" not in secrets
        else:
            assert ports["http"] == args.http_port and args.host == "0.0.0.0"
            assert ports["cluster"] == args.cluster_port == router_cluster_port
            assert "SPLITSERVE_API_KEY" in secrets
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_service_and_podmonitor_match_pods() -> None:
    docs = _docs()
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    router = [d for d in docs if d["kind"] == "Deployment"
              and d["metadata"]["name"] == "splitserve-router"][0]
    assert svc["spec"]["selector"].items() <= router["spec"]["template"]["metadata"][
        "labels"].items()
    names = {p["name"] for p in router["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    all_ports = {p["name"] for d in docs if d["kind"] == "Deployment"
                 for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= all_ports
