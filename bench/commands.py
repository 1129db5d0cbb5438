"""The `bench` and `plan` subcommands of `splitserve`, registered into its command table.

deploy/cli.py sits below bench/ (bench drives clusters that deploy/ starts), so it cannot import
these: it finds them through the `splitserve.commands` entry points (pyproject.toml), each a
function that adds its subparsers.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (help, the module with its `add_arguments(parser)` and `main(args) -> exit code`)
COMMANDS = {"bench": ("SLO-driven load test against a router", "bench.run"),
            "plan": ("recommend prefill:decode counts from measured profiles", "bench.planner")}


def register(sub: argparse._SubParsersAction) -> None:
    for name, (help_text, module) in COMMANDS.items():
        command = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text)
        command.add_arguments(p)
        p.set_defaults(func=command.main)
