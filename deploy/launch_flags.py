"""The settings a launcher (`up`, `ray up`) takes and hands on to the processes it starts.

A launcher runs a router and workers, so it takes their settings: every field of RouterConfig,
WorkerConfig, EngineConfig and ConnectorSettings has a flag here, but those the launcher decides
itself (where each component binds, which cores each engine gets, ...), listed per launcher.
Children get argv made from the same schema (splitserve/settings.py), so a setting added to a
config reaches every process that uses it with no change here.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from router.config import RouterConfig
from router.validation import RequestLimits
from splitserve.engine import EngineConfig
from splitserve.kv.settings import ConnectorSettings
from splitserve.settings import add_flags, argv, values
from splitserve.worker.config import WorkerConfig

KV = "kv-"  # the prefix of the KV connector's flags

Side = tuple[tuple[type, str], ...]  # (config, flag prefix) pairs

# (config, flag prefix) of every component setting, in the order --help shows them.
COMPONENTS: Side = ((EngineConfig, ""), (ConnectorSettings, KV), (RouterConfig, ""),
              (RequestLimits, ""), (WorkerConfig, ""))
# What a worker hands its engine, and what the router takes, of those.
WORKER_SIDE: Side = ((WorkerConfig, ""), (EngineConfig, ""), (ConnectorSettings, KV))
ROUTER_SIDE: Side = ((RouterConfig, ""), (RequestLimits, ""))

Decides = Mapping[type, frozenset[str]]

# `up`: one host, loopback; it places each component and gives each engine its own core.
UP_DECIDES: Decides = {
    EngineConfig: frozenset({"model", "cpu_cores"}),  # --model resolved once, for everyone
    RouterConfig: frozenset({"host", "port", "cluster_port", "static_prefill", "static_decode",
                             "static_colocated"}),
    WorkerConfig: frozenset({"host", "port", "advertise_host", "router", "worker_id",
                             "metrics_port"}),
}
# `ray up`: Ray places the actors (and their CPUs); its own flags name the router's ports.
RAY_DECIDES: Decides = {
    EngineConfig: frozenset({"model", "cpu_cores"}),
    RouterConfig: frozenset({"host", "port", "cluster_port", "http_port", "static_prefill",
                             "static_decode", "static_colocated"}),
    WorkerConfig: frozenset({"host", "port", "advertise_host", "router", "worker_id",
                             "metrics_port"}),
}


_TITLES = {EngineConfig: "engine", ConnectorSettings: "KV transfer", RouterConfig: "router",
           RequestLimits: "request limits (router)", WorkerConfig: "worker"}


def add_component_flags(p: argparse.ArgumentParser, configs: Side = COMPONENTS,
                        decides: Decides | None = None) -> None:
    """The flags of `configs`' settings (every component's, or one side's, as a component
    command takes them), but those the launcher `decides`."""
    for cls, prefix in configs:
        add_flags(p, cls, prefix, skip=(decides or {}).get(cls, ()), title=_TITLES[cls])


def child_argv(a: argparse.Namespace, side: Side, decides: Decides) -> list[str]:
    """Flags for a child on `side` (WORKER_SIDE, ROUTER_SIDE): the settings given to the
    launcher, but what the launcher decides (and passes itself)."""
    return [x for cls, prefix in side
            for x in argv(cls, values(cls, a, prefix), prefix, skip=decides.get(cls, ()))]
