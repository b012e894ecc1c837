"""A standing chaos suite: each module attacks a live `tandem serve` one way and says what it expected and saw.

A probe is a function `probe(ctx: ChaosContext) -> list[Outcome]`; modules list theirs in `PROBES`. Every probe is
bounded in time and count and talks to 127.0.0.1 only. `benchmarks/chaos.py` runs them all and prints the table."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Outcome:
    """One row of the table: what was done, what should happen, what did."""

    attack: str
    expected: str
    observed: str
    passed: bool


@dataclass
class ChaosContext:
    """What a probe gets: a directory for logs and servers it starts, the tiny checkpoints, a time cap."""

    workdir: Path
    ar_model: Path                     # a tiny autoregressive checkpoint (HF layout)
    dllm_model: Path | None = None     # the committed tiny SDAR, when the probe needs one
    budget_s: float = 30.0             # a probe should end within about this long
    notes: list[str] = field(default_factory=list)


Probe = Callable[[ChaosContext], list[Outcome]]
