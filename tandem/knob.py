"""A configuration knob, declared once as a dataclass field: its default, its help and how a command line's text
becomes its value travel with the field, so every `tandem` flag is generated from one (tandem.cli.args) and no
default is written twice. The value parsers here raise KnobError, a ValueError naming what was expected.

The lowest module of tandem: it imports nothing of the package.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

KNOB = "tandem.knob"          # the metadata key of a knob's field
OVERRIDE = "tandem.knob.override"   # metadata key: why a shared knob has another default in this config


class KnobError(ValueError):
    """A value a knob refuses; the message says what was expected."""


@dataclass(frozen=True, eq=False)
class Knob:
    """How one configuration field appears on the command line."""

    help: str
    parse: Callable[[str], Any] | None = None   # text -> value (KnobError when refused); None: the text itself
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    flags: tuple[str, ...] = ()                 # the spellings users know; () gives --field-name
    show_default: bool = True                   # append "(default: X)" to the help when the default is a value
    repeat: bool = False                        # the flag may be given several times: the values make a list


def knob(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING, **cli: Any) -> Any:
    """A dataclass field that is a knob: `default` (or `default_factory`) is its one default."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={KNOB: Knob(help, **cli)})


def shared(owner: type, name: str, *, default: Any = MISSING, why: str = "") -> Any:
    """The knob `name` of config `owner` repeated in another config: the same Knob and default, so it is still
    defined once; a different `default` needs `why` (it is then a stated override, not a copy)."""
    f = owner.__dataclass_fields__[name]
    if KNOB not in f.metadata:
        raise TypeError(f"{owner.__name__}.{name} is not a knob")
    meta = {KNOB: f.metadata[KNOB]}
    if default is not MISSING:
        if not why:
            raise TypeError(f"a new default for {owner.__name__}.{name} needs its reason")
        meta[OVERRIDE] = why
        return dataclasses.field(default=default, metadata=meta)
    return dataclasses.field(default=f.default, default_factory=f.default_factory, metadata=meta)


def knob_of(f: dataclasses.Field) -> Knob | None:
    """The Knob of a dataclass field (None: not a knob)."""
    return f.metadata.get(KNOB)


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value (a fresh one from its factory); MISSING for a required field."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


# --------------------------------------------------------------------------- value parsers


def _number(text: str, cast, expected: str, ok, rule: str):
    """text cast to a number, or a KnobError naming what was expected or the rule it breaks."""
    try:
        x = cast(text)
    except ValueError:
        raise KnobError(f"expected {expected}, got {text!r}") from None
    if not ok(x):
        raise KnobError(f"must be {rule}, got {text!r}")
    return x


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _number(text, float, "a number", lambda x: math.isfinite(x) and x > 0, "> 0")


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, float, "a number", lambda x: math.isfinite(x) and x >= 0, ">= 0")


def unit_fraction(text: str) -> float:
    """A number in (0, 1]."""
    return _number(text, float, "a number in (0, 1]", lambda x: 0 < x <= 1, "in (0, 1]")


def share(text: str) -> float:
    """A number in [0, 1)."""
    return _number(text, float, "a number in [0, 1)", lambda x: 0 <= x < 1, "in [0, 1)")


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _number(text, int, "an integer", lambda x: x >= 1, ">= 1")


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    return _number(text, int, "an integer", lambda x: x >= 0, ">= 0")


def seed(text: str) -> int:
    """A seed: an integer >= 0."""
    return _number(text, int, "an integer seed", lambda x: x >= 0, ">= 0")


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    return _number(text, int, "a port number", lambda x: 0 <= x <= 65535, "in [0, 65535]")


_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """A byte count: an integer, optionally with a binary suffix K, M, G or T (KiB, MiB, ...; 4G = 4 GiB)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _BYTE_UNITS else ""
    try:
        n = int(t[:len(t) - len(unit)]) * _BYTE_UNITS[unit]
    except ValueError:
        raise KnobError(f"expected bytes such as 4G, 512M or 1048576, got {text!r}") from None
    if n < 1:
        raise KnobError(f"must be >= 1 byte, got {text!r}")
    return n


def csv_list(item: Callable[[str], Any]) -> Callable[[str], list]:
    """A parser of a comma-separated list of `item` values."""
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise KnobError(f"expected a comma-separated list, got {text!r}")
        return [item(t) for t in items]
    parse.__name__ = f"csv_list({getattr(item, '__name__', 'item')})"
    return parse


def argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A value parser as an argparse type (the knobs' generated flags, hand-written flags of the scripts under
    benchmarks/): its KnobError becomes the one-line message argparse prints."""
    import argparse

    def typed(text: str) -> Any:
        try:
            return parse(text)
        except KnobError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    typed.__name__ = getattr(parse, "__name__", "value")
    return typed
