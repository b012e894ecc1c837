"""Command-line flags generated from configuration fields (tandem.knob), as vLLM's EngineArgs.add_cli_args: the
flag's name, type, choices, help and default come from the field, so a command never restates a default. Each
generated action remembers its field (`knob_source`), which tests/test_cli_knobs.py checks for every flag."""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from typing import Any

from dataclasses import MISSING

from tandem.knob import argparse_type, field_default, knob_of


def _optional_bool(f: dataclasses.Field) -> bool:
    """Whether the field is declared `bool | None` (a switch that may be left unset)."""
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace(" ", "") in ("bool|None", "None|bool", "Optional[bool]")


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_knob(parser: argparse.ArgumentParser | Any, cls: type, name: str, *, required: bool = False) -> argparse.Action:
    """Add the flag of `cls`'s knob field `name` to `parser` (a parser or an argument group)."""
    f = cls.__dataclass_fields__[name]
    k = knob_of(f)
    if k is None:
        raise TypeError(f"{cls.__name__}.{name} is not a knob")
    default = field_default(f)
    if default is MISSING:
        default, required = None, True
    flags = k.flags or ("--" + name.replace("_", "-"),)
    help_ = k.help
    if k.show_default and not required and default is not None and not isinstance(default, bool) and default != []:
        help_ = f"{help_} (default: {_show(default)})" if help_ else f"default: {_show(default)}"
    kw: dict[str, Any] = {"dest": name, "help": help_ or None}
    if isinstance(default, bool) and k.parse is None:
        kw["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        kw["default"] = default
    elif default is None and k.parse is None and _optional_bool(f):   # --x/--no-x; None: neither given
        kw.update(action=argparse.BooleanOptionalAction, default=None)
    else:
        kw.update(default=default, type=k.parse and argparse_type(k.parse), metavar=k.metavar, choices=k.choices)
        if k.repeat:
            kw["action"] = "append"
        if required:
            kw["required"] = True
    action = parser.add_argument(*flags, **kw)
    action.knob_source = (cls, name)        # type: ignore[attr-defined]
    return action


def add_knobs(parser: argparse.ArgumentParser | Any, cls: type, names: Iterable[str] | None = None, *,
              exclude: Iterable[str] = (), required: Iterable[str] = ()) -> None:
    """Add the flags of `cls`'s knob fields: `names` in that order (default: every knob field, in field order)."""
    skip, must = set(exclude), set(required)
    if names is None:
        names = [f.name for f in dataclasses.fields(cls) if knob_of(f) is not None]
    for name in names:
        if name not in skip:
            add_knob(parser, cls, name, required=name in must)


def knob_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of `cls`'s knob fields found in `args`, by field name (to build `cls` from a command line)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if knob_of(f) is not None and hasattr(args, f.name)}
