"""The `bench` and `plan` subcommands of `splitserve`, registered into its command table.

deploy/cli.py sits below bench/ (bench drives clusters that deploy/ starts), so it cannot import
these: it finds them through the `splitserve.commands` entry points (pyproject.toml), each a
function that adds its subparsers.
"""

from __future__ import annotations

import argparse


def _bench(a: argparse.Namespace) -> int:
    from bench.run import main

    return main(a)


def _plan(a: argparse.Namespace) -> int:
    from bench.planner import main

    return main(a)


def register(sub: argparse._SubParsersAction) -> None:
    from bench.planner import add_arguments as plan_arguments
    from bench.run import add_arguments

    b = sub.add_parser("bench", help="SLO-driven load test against a router")
    add_arguments(b)
    b.set_defaults(func=_bench)
    pl = sub.add_parser("plan", help="recommend prefill:decode counts from measured profiles")
    plan_arguments(pl)
    pl.set_defaults(func=_plan)
