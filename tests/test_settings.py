"""One schema for every setting (splitserve/settings.py): every command that runs a component
takes each of its settings, with the field's default, shown once; what a launcher takes reaches
its children unchanged; a --config file says the same as the flags."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from deploy.cli import build_parser
from deploy.launch_flags import (
    COMPONENTS,
    KV,
    RAY_DECIDES,
    ROUTER_SIDE,
    UP_DECIDES,
    WORKER_SIDE,
    child_argv,
)
from deploy.local import UpConfig
from router.config import RouterConfig
from router.validation import RequestLimits
from splitserve.engine import EngineConfig
from splitserve.kv.settings import ConnectorSettings
from splitserve.roles import Role
from splitserve.settings import default_of, flag_fields, parse_args, values
from splitserve.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
WORKER = ((WorkerConfig, ""), (EngineConfig, ""), (ConnectorSettings, KV))
ROUTER = ((RouterConfig, ""), (RequestLimits, ""))
# (command, the configs it runs, what it decides itself)
COMMANDS = [(("router",), ROUTER, {}), *(((r.value,), WORKER, {}) for r in Role),
            (("up",), (*COMPONENTS, (UpConfig, "")), UP_DECIDES),
            (("ray", "up"), COMPONENTS, RAY_DECIDES)]


def _subparser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    p = build_parser()
    for name in path:
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = sub.choices[name]
    return p


@pytest.mark.parametrize("path,configs,decides", COMMANDS, ids=lambda x: " ".join(x)
                         if isinstance(x, tuple) and x and isinstance(x[0], str) else None)
def test_every_setting_reaches_every_command_that_runs_it(path, configs, decides) -> None:
    p = _subparser(path)
    by_dest = {a.dest: a for a in p._actions}
    missing, wrong = [], []
    for cls, prefix in configs:
        for f, flag, dest in flag_fields(cls, prefix):
            if f.name in decides.get(cls, ()):
                continue
            action = by_dest.get(dest)
            if action is None:
                missing.append(f"{cls.__name__}.{f.name} ({flag})")
                continue
            default = action.default
            if (tuple(default) if isinstance(default, list) else default) != default_of(f):
                wrong.append(f"{flag}: {default!r} != {cls.__name__}.{f.name} {default_of(f)!r}")
    assert not missing, f"`{' '.join(path)}` lacks flags for {missing}"
    assert not wrong, f"`{' '.join(path)}` defaults differ from the configs': {wrong}"
    # Shown once: no two options for one destination (two configs' shared field, one flag).
    dests = [a.dest for a in p._actions if a.option_strings]
    assert len(dests) == len(set(dests)), sorted(d for d in dests if dests.count(d) > 1)


@pytest.mark.parametrize("decides", [UP_DECIDES, RAY_DECIDES], ids=["up", "ray up"])
def test_configs_sharing_a_flag_agree_on_its_default(decides) -> None:
    """A launcher gives one flag to the fields of one name (the engine's and the router's
    max_model_len): their defaults must be one."""
    seen: dict[str, tuple[str, object]] = {}
    for cls, prefix in COMPONENTS:
        for f, _, dest in flag_fields(cls, prefix):
            if f.name in decides.get(cls, ()):
                continue
            if dest in seen:
                assert seen[dest][1] == default_of(f), (dest, seen[dest], cls.__name__)
            seen[dest] = (cls.__name__, default_of(f))


def _other_value(cls: type, f: dataclasses.Field) -> str | list[str] | None:
    """A command-line value for `f` other than its default (None: a boolean, flipped)."""
    tp = typing.get_type_hints(cls)[f.name]
    meta = f.metadata["splitserve"]
    default = default_of(f)
    if meta["choices"]:
        return next(c for c in meta["choices"] if c != default)
    text = str(tp)
    if "bool" in text:
        return None
    if "tuple" in text:
        return ["10.0.0.7:1", "10.0.0.8:2"]
    if "int" in text:
        return str((default or 0) + 3)
    if "float" in text:
        return str((default or 0) + 0.25)
    return f"value-of-{f.name}"


@pytest.mark.parametrize("launcher,decides", [(("up",), UP_DECIDES),
                                               (("ray", "up"), RAY_DECIDES)],
                         ids=["up", "ray up"])
def test_what_a_launcher_takes_reaches_its_children_unchanged(launcher, decides) -> None:
    """Every setting at a non-default value: the router and each worker role parse the argv
    the launcher made into exactly the values the launcher was given."""
    args, want = [], {}
    for cls, prefix in COMPONENTS:
        for f, flag, dest in flag_fields(cls, prefix):
            if f.name in decides.get(cls, ()) or dest in want:
                continue
            value = _other_value(cls, f)
            if value is None:
                args.append(f"--no-{flag[2:]}" if default_of(f) else flag)
            else:
                args += [x for v in (value if isinstance(value, list) else [value])
                         for x in (flag, v)]
            want[dest] = value
    a = build_parser().parse_args([*launcher, *args])
    for side, command, configs in ((ROUTER_SIDE, "router", ROUTER),
                                   (WORKER_SIDE, "decode", WORKER)):
        child = build_parser().parse_args([command, *child_argv(a, side, decides)])
        for cls, prefix in configs:
            got, given = values(cls, child, prefix), values(cls, a, prefix)
            for name in set(given) - set(decides.get(cls, ())):
                assert got[name] == given[name], (command, cls.__name__, name)
                assert given[name] != default_of(next(f for f in dataclasses.fields(cls)
                                                      if f.name == name)), name


def test_defaults_make_valid_configs(tmp_path: Path) -> None:
    a = build_parser().parse_args(["decode"])
    kv = ConnectorSettings(**values(ConnectorSettings, a, KV))
    engine = EngineConfig(**{**values(EngineConfig, a), "model": str(tmp_path)}, kv_settings=kv)
    WorkerConfig(role=Role.DECODE, engine=engine, **values(WorkerConfig, a))
    r = build_parser().parse_args(["router"])
    RouterConfig(model_dir=str(tmp_path), **values(RouterConfig, r),
                 limits=RequestLimits(**values(RequestLimits, r)))


def test_a_config_file_gives_settings_and_flags_win(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    # One file for every component: the router's and the workers' settings side by side.
    f.write_text(yaml.safe_dump({"kv-lease-s": 7.5, "max_num_seqs": 9, "kv-load": "async",
                                 "max-concurrency": 11, "static-decode": ["10.0.0.1:5"],
                                 "prefix-affinity": False}))
    a = parse_args(build_parser(), ["decode", "--config", str(f), "--kv-lease-s", "3"])
    assert (a.kv_lease_s, a.max_num_seqs, a.kv_load) == (3.0, 9, "async")  # the flag won
    r = parse_args(build_parser(), ["router", "--config", str(f)])
    assert (r.max_concurrency, r.static_decode, r.prefix_affinity) == (11, ["10.0.0.1:5"], False)
    u = parse_args(build_parser(), ["up", "--config", str(f)])
    assert (u.max_concurrency, u.kv_lease_s) == (11, 7.5)


@pytest.mark.parametrize("content,says", [({"kv-lease": 1}, "unknown setting 'kv-lease'"),
                                          ({"kv-load": "later"}, "is not one of"),
                                          ({"max-num-seqs": "many"}, "not a int"),
                                          ([1, 2], "expected a mapping")])
def test_a_bad_config_file_is_refused_with_its_reason(tmp_path: Path, capsys, content,
                                                      says) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(content))
    with pytest.raises(SystemExit) as e:
        parse_args(build_parser(), ["decode", "--config", str(f)])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_test_faults_are_no_setting() -> None:
    """Faults (splitserve/faults.py) come from $SPLITSERVE_FAULTS alone: no flag names them."""
    help_text = "".join(_subparser(path).format_help() for path, _, _ in COMMANDS)
    for word in ("stall", "fault", "corrupt", "debug"):
        assert not re.search(rf"\b{word}", help_text, re.I), word
