"""The docs name only what exists: every `--flag` in README.md and docs/ is one of ours (or a named
other tool's), and every `splitserve:` metric in them, in the Grafana dashboard and in the
Kubernetes manifests is one a component exports."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Flags of other tools the docs show in their own commands.
FOREIGN_FLAGS = {
    "--async-scheduling": "vLLM's `vllm serve`",
    "--build-arg": "docker build",
    "--from-literal": "kubectl create secret",
    "--head": "ray start",
    "--no-deps": "pip install",
}
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]+)")
_METRIC = re.compile(r"splitserve:[a-z_][a-z0-9_]*")  # not an image tag (splitserve:0.1)


def _named(pattern: re.Pattern, files: list[Path]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in files:
        for m in pattern.finditer(f.read_text()):
            out.setdefault(m.group(0).rstrip("_") if pattern is _METRIC else m.group(1),
                           []).append(f.relative_to(ROOT).as_posix())
    return out


def _cli_flags() -> set[str]:
    """Every long option of `splitserve` and its subcommands (the real parsers), and of the
    scripts in bench/ and scripts/ (their literal add_argument calls)."""
    from deploy.cli import build_parser

    flags: set[str] = set()

    def walk(p: argparse.ArgumentParser) -> None:
        for a in p._actions:
            flags.update(s for s in a.option_strings if s.startswith("--"))
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    walk(sub)

    walk(build_parser())
    for f in [*ROOT.glob("bench/*.py"), *ROOT.glob("scripts/*.py")]:
        flags |= set(re.findall(r"""add_argument\(\s*["'](--[a-z][a-z0-9-]+)["']""",
                                f.read_text()))
    for f in ROOT.glob("scripts/*.sh"):  # a shell script's options: the words it tests for
        flags |= set(re.findall(r"""["'](--[a-z][a-z0-9-]+)["']""", f.read_text()))
    return flags


def test_every_flag_the_docs_name_exists() -> None:
    named = _named(_FLAG, DOCS)
    unknown = {f: where for f, where in named.items()
               if f not in _cli_flags() and f not in FOREIGN_FLAGS}
    assert not unknown, f"flags named in the docs that nothing defines: {unknown}"
    stale = set(FOREIGN_FLAGS) - set(named)
    assert not stale, f"FOREIGN_FLAGS no doc uses any more: {stale}"


def _families(registry: CollectorRegistry) -> dict[str, str]:
    return {m.name: m.type for m in registry.collect()}


def _router_families() -> dict[str, str]:
    """The router's metric families, from its real registry."""
    from router.connections import ConnectionMetrics
    from router.metrics import RouterMetrics

    reg = CollectorRegistry()
    RouterMetrics(reg, "m")
    ConnectionMetrics(reg, "m")
    return _families(reg)


def _exported() -> set[str]:
    """The names a scrape can show: each family's, and its samples' (`_total`, `_bucket`...)."""
    families = _router_families()
    # The worker's collector reads a live engine at scrape time (loading its module loads
    # vLLM): its families are read from the source, in the spelling the router's check below
    # holds to its real registry.
    worker = (ROOT / "splitserve/worker/metrics.py").read_text()
    for kind, name in re.findall(r'(gauge|counter|GaugeMetricFamily|Histogram)\(\s*"'
                                 r'(splitserve:[a-z0-9_]+)"', worker):
        families[name] = {"gauge": "gauge", "GaugeMetricFamily": "gauge", "counter": "counter",
                          "Histogram": "histogram"}[kind]
    suffixes = {"counter": ("_total", "_created"), "gauge": (),
                "histogram": ("_bucket", "_sum", "_count", "_created")}
    return {n + s for n, kind in families.items() for s in ("", *suffixes[kind])}


def test_the_source_scan_reads_the_router_as_its_registry_does() -> None:
    """The worker's names come from a scan of its source: the same scan of the router's source
    must find exactly what the router's registry holds."""
    src = "".join((ROOT / f).read_text() for f in ("router/metrics.py", "router/connections.py"))
    scanned = set(re.findall(r'(?:Counter|Gauge|Histogram)\(\s*"(splitserve:[a-z0-9_]+)"', src))
    assert scanned == set(_router_families())


def test_every_metric_the_docs_and_dashboard_name_is_exported() -> None:
    files = [*DOCS, *ROOT.glob("deploy/grafana/*.json"), *ROOT.glob("deploy/k8s/**/*.yaml")]
    exported = _exported()
    unknown = {m: where for m, where in _named(_METRIC, files).items()
               if m not in exported
               and not any(e.startswith(m + "_") for e in exported)}  # a prefix: kv_held_*
    assert not unknown, f"metrics named that no component exports: {unknown}"
