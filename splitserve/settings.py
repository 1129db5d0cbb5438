"""One schema for every setting: the components' frozen config dataclasses.

A setting is written once, as a dataclass field whose metadata carries its help text (`setting`);
its name, type, default and unit (the name's suffix: `_s` seconds, `_mib` MiB) come from the
field itself. Everything else is generated from that:
  add_flags(parser, Config)   the command-line flags of every command that runs the component
  values(Config, namespace)   what the flags said, ready for Config(**...)
  argv(Config, mapping)       the flags that hand the same values to a child process
  --config FILE               a YAML file of `flag-name: value` that every command reads (flags
                              given on the command line win); one file may serve every
                              component: each takes the settings it has, and a name that no
                              command knows is an error
A field that code sets (a role, a nested record, a secret that comes from the environment) is
`internal`: no flag. Two configs run by one command that share a field name (the engine's and
the router's max_model_len) share one flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_UNITS = {"_s": "SECONDS", "_mib": "MIB"}


def setting(default: Any = dataclasses.MISSING, help: str = "", *,
            factory: Any = dataclasses.MISSING, flag: str | None = None,
            choices: Iterable[str] | None = None, metavar: str | None = None,
            internal: bool = False, repr: bool = True) -> Any:
    """A config field with what its flag needs: `help` (shown once, in every command that runs
    the component), `flag` where it is not the field's name, `choices`, `internal` for fields no
    user sets."""
    meta = {"help": help, "flag": flag, "choices": tuple(choices) if choices else None,
            "metavar": metavar, "internal": internal}
    return dataclasses.field(default=default, default_factory=factory, repr=repr,
                             metadata={"splitserve": meta})


def _meta(f: dataclasses.Field) -> dict:
    return f.metadata.get("splitserve") or {"help": "", "flag": None, "choices": None,
                                            "metavar": None, "internal": False}


def _scalar(tp: Any) -> tuple[type, bool, bool]:
    """(element type, optional, repeated) of a field's annotation."""
    optional = False
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [t for t in typing.get_args(tp) if t is not type(None)]
        optional, tp = True, args[0]
    if typing.get_origin(tp) in (tuple, list):
        return typing.get_args(tp)[0], optional, True
    return tp, optional, False


def flag_fields(cls: type, prefix: str = "") -> list[tuple[dataclasses.Field, str, str]]:
    """(field, --flag, dest) for every field of `cls` that has a flag."""
    out = []
    for f in dataclasses.fields(cls):
        m = _meta(f)
        if m["internal"]:
            continue
        name = m["flag"] or f"--{prefix}{f.name.replace('_', '-')}"
        out.append((f, name, prefix.replace("-", "_") + f.name))
    return out


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
              prefix: str = "", skip: Iterable[str] = (), only: Iterable[str] | None = None,
              title: str | None = None) -> None:
    """`cls`'s flags on `parser` (in a group titled `title`), but the fields named in `skip` (or
    only those in `only`): fields a launcher decides itself. A dest or flag the parser already
    has (a field shared with another config of the same command, or a launcher's own flag of
    that name) is not added twice."""
    skip, only = set(skip), None if only is None else set(only)
    hints = typing.get_type_hints(cls)
    target = parser.add_argument_group(title) if title else parser
    have = {a.dest for a in _actions(parser)}
    have_opts = {o for a in _actions(parser) for o in a.option_strings}
    for f, name, dest in flag_fields(cls, prefix):
        if (f.name in skip or (only is not None and f.name not in only) or dest in have
                or name in have_opts):
            continue
        m = _meta(f)
        tp, optional, repeated = _scalar(hints[f.name])
        default = default_of(f)
        kw: dict[str, Any] = {"dest": dest, "help": m["help"] or None}
        if tp is bool:
            kw.update(action=argparse.BooleanOptionalAction, default=default)
        else:
            unit = next((u for s, u in _UNITS.items() if f.name.endswith(s)), None)
            kw.update(type=tp, default=list(default) if repeated else default,
                      metavar=m["metavar"] or (None if m["choices"] else unit))
            if repeated:
                kw["action"] = "append"
            if m["choices"]:
                kw["choices"] = m["choices"]
        if kw["help"] and default not in (None, (), []) and "default" not in kw["help"]:
            kw["help"] += " (default: %(default)s)"
        target.add_argument(name, **kw)


def _actions(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> list[argparse.Action]:
    return list(parser._actions)


def _getter(obj: Any):
    """name -> obj's value of that name (a mapping's item or an attribute); MISSING if none."""
    if isinstance(obj, Mapping):
        return lambda k: obj.get(k, dataclasses.MISSING)
    return lambda k: getattr(obj, k, dataclasses.MISSING)


def values(cls: type, ns: argparse.Namespace | Mapping[str, Any], prefix: str = "",
           skip: Iterable[str] = ()) -> dict[str, Any]:
    """{field: value} of `cls`'s flags in a parsed namespace (fields without a flag there, and
    those in `skip`, are left out: the dataclass's default, or the caller, fills them)."""
    get = _getter(ns)
    out = {}
    for f, _, dest in flag_fields(cls, prefix):
        if f.name in skip:
            continue
        value = get(dest)
        if value is dataclasses.MISSING:
            continue
        out[f.name] = tuple(value) if isinstance(value, list) else value
    return out


def argv(cls: type, obj: Any, prefix: str = "", skip: Iterable[str] = ()) -> list[str]:
    """The flags that give a child process `obj`'s settings (a `cls` instance, or a mapping of
    field to value): those that differ from the default, which the child shares."""
    skip = set(skip)
    get = _getter(obj)
    out: list[str] = []
    for f, name, _ in flag_fields(cls, prefix):
        value = get(f.name)
        if f.name in skip or value is dataclasses.MISSING or value == default_of(f):
            continue
        if isinstance(value, bool):
            out.append(name if value else f"--no-{name[2:]}")
        elif isinstance(value, (tuple, list)):
            out += [x for v in value for x in (name, str(v))]
        elif value is not None:
            out += [name, str(value)]
    return out


# --config ---------------------------------------------------------------------------------

def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="settings from a YAML file of flag-name: value (flags given here "
                             "win); one file can serve every component, each takes its own")
    parser.set_defaults(_settings_parser=parser)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o[2:]: a for a in _actions(parser) for o in a.option_strings if o.startswith("--")}


def _every_option(parser: argparse.ArgumentParser) -> set[str]:
    names = set(_options(parser))
    for a in _actions(parser):
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                names |= _every_option(sub)
    return names


def parse_args(parser: argparse.ArgumentParser, args: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, with the chosen command's --config file (if any) as its defaults."""
    ns = parser.parse_args(args)
    path = getattr(ns, "config", None)
    if not path:
        return ns
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config {path}: {e}")
    if not isinstance(raw, dict):
        parser.error(f"--config {path}: expected a mapping of flag-name: value")
    sub: argparse.ArgumentParser = ns._settings_parser
    options, known = _options(sub), _every_option(parser)
    defaults = {}
    for key, value in raw.items():
        name = str(key).replace("_", "-")
        if name not in known or name in ("config", "help"):
            parser.error(f"--config {path}: unknown setting {key!r}")
        action = options.get(name)
        if action is None:
            continue  # another component's setting
        if isinstance(action, argparse._AppendAction):
            value = [action.type(v) if action.type else v
                     for v in (value if isinstance(value, list) else [value])]
        elif action.type is not None and value is not None:
            try:
                value = action.type(value)
            except (TypeError, ValueError):
                parser.error(f"--config {path}: {key}: not a {action.type.__name__}: {value!r}")
        if action.choices and value not in action.choices:
            parser.error(f"--config {path}: {key}: {value!r} is not one of {list(action.choices)}")
        defaults[action.dest] = value
    sub.set_defaults(**defaults)
    return parser.parse_args(args)
