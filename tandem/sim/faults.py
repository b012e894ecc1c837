"""Faults the simulator injects (`tandem simulate --faults`): KV transfers that fail or are lost, workers
that die at given times. The coordinator core decides what each costs, as it does when serving."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import Enum


class FaultError(ValueError):
    """A --faults specification is malformed or out of range."""


class Fate(Enum):
    """What happens to one KV transfer."""

    OK = 0
    FAIL = 1        # it runs, then reports an error (the coordinator falls back at once)
    LOST = 2        # it never lands (the coordinator falls back after kv_timeout_s)


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """kv_fail / kv_lost: probability that a KV transfer fails / is lost; kills: (worker, time_s) pairs."""

    kv_fail: float = 0.0
    kv_lost: float = 0.0
    kills: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("kv_fail", "kv_lost"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise FaultError(f"{name.replace('_', '-')} must be a probability in [0, 1], got {v!r}")
        if self.kv_fail + self.kv_lost > 1.0:
            raise FaultError("kv-fail + kv-lost must not exceed 1")
        for w, t in self.kills:
            if w < 0 or not t >= 0:
                raise FaultError(f"kill=WORKER@SECONDS needs a worker id >= 0 and a time >= 0, got {w}@{t}")

    @property
    def any(self) -> bool:
        return bool(self.kv_fail or self.kv_lost or self.kills)

    def __str__(self) -> str:
        parts = []
        if self.kv_fail:
            parts.append(f"kv-fail={self.kv_fail:g}")
        if self.kv_lost:
            parts.append(f"kv-lost={self.kv_lost:g}")
        parts += [f"kill={w}@{t:g}" for w, t in self.kills]
        return ",".join(parts) or "none"


def parse_faults(text: str) -> FaultSpec:
    """Parse "kv-fail=0.05,kv-lost=0.01,kill=3@120" (any subset, comma-separated)."""
    fail = lost = 0.0
    kills: list[tuple[int, float]] = []
    if not text or not text.strip():
        raise FaultError("empty --faults; expected e.g. 'kv-fail=0.05', 'kv-lost=0.01' or 'kill=1@300'")
    for part in text.split(","):
        key, sep, val = part.strip().partition("=")
        key = key.strip().lower()
        if not sep:
            raise FaultError(f"cannot parse fault {part.strip()!r}; expected KEY=VALUE")
        try:
            if key == "kv-fail":
                fail = float(val)
            elif key == "kv-lost":
                lost = float(val)
            elif key == "kill":
                w, at, t = val.partition("@")
                if not at:
                    raise ValueError
                kills.append((int(w), float(t)))
            else:
                raise FaultError(f"unknown fault {key!r}; choose kv-fail, kv-lost or kill")
        except ValueError as e:
            if isinstance(e, FaultError):
                raise
            raise FaultError(f"bad value in fault {part.strip()!r}") from None
    return FaultSpec(fail, lost, tuple(kills))


class FaultInjector:
    """Draws each transfer's fate from a seeded generator (same seed, same faults)."""

    def __init__(self, spec: FaultSpec, seed: int) -> None:
        self.spec = spec
        self.rng = random.Random(seed ^ 0x5EEDFA17)
        self.failed = 0
        self.lost = 0

    def fate(self) -> Fate:
        s = self.spec
        if not (s.kv_fail or s.kv_lost):
            return Fate.OK
        x = self.rng.random()
        if x < s.kv_fail:
            self.failed += 1
            return Fate.FAIL
        if x < s.kv_fail + s.kv_lost:
            self.lost += 1
            return Fate.LOST
        return Fate.OK
