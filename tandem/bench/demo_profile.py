"""The demo's quick profile, cached beside the model and kept only while it still describes this machine.

A profile is a property of the machine as the demo will use it: the CPU model, the cores this process may run on
(its affinity: `taskset -c 0` leaves one) and the torch threads each worker runs. The cache is keyed by those
(`MachineKey`): one file per thread count and core count, its key kept beside it with a speed baseline, and a
changed CPU model or torch means profiling again. The same key does not mean the same speed (other jobs on a
shared machine, a slower virtual CPU), so before each run a speed check times a few of the profile's steps again
(about a second) and compares them with the same steps timed just after profiling (the same harness both times:
its bias cancels). Off by more than SPEED_TOLERANCE either way, the profile is made again (a quick profile takes
about 10 s on two cores) and the run's rate and SLO follow it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

SPEED_TOLERANCE = 1.25       # profile again when the checked steps run this many times slower (or faster)
SPEED_REPEATS = 15           # interleaved passes over the checked steps; the median of each step is kept
# the checked steps: (kind, prefills as (history, new tokens), decodes as KV lengths), the demo's sizes
SPEED_POINTS: tuple[tuple[str, tuple[tuple[int, int], ...], tuple[int, ...]], ...] = (
    ("prefill", ((0, 128),), ()), ("prefill", ((0, 512),), ()), ("prefill", ((512, 64),), ()),
    ("decode", (), (128,)), ("decode", (), (512,)), ("decode", (), (512,) * 4))
SPEED_KV_BLOCKS = 512        # the speed check's KV pool (blocks): enough for its largest step
SIDECAR_VERSION = 1


@dataclass(frozen=True, slots=True)
class MachineKey:
    """What a cached profile was measured on: what sets the speed of the demo's workers."""

    cpu: str            # the CPU model
    cores: int          # the cores this process may run on (its affinity)
    threads: int        # torch threads per worker
    torch: str          # torch's version (kernels change between versions)

    @property
    def parallel(self) -> int:
        """How many single-worker steps the cores run at once: cores over threads per worker (at least 1)."""
        return max(1, self.cores // max(1, self.threads))


@dataclass(frozen=True, slots=True)
class SpeedVerdict:
    """The speed check: each kind's checked steps now over the same steps just after profiling (medians)."""

    prefill: float
    decode: float
    tolerance: float

    @property
    def stale(self) -> bool:
        """Whether the machine runs measurably slower or faster than when the profile was made."""
        return any(not 1 / self.tolerance <= r <= self.tolerance for r in (self.prefill, self.decode))

    def describe(self) -> str:
        """One line: the ratios and what follows from them."""
        ratios = f"prefill steps x{self.prefill:.2f}, decode steps x{self.decode:.2f} of their time after profiling"
        if self.stale:
            return f"speed check: {ratios}, beyond x{self.tolerance:g} either way"
        return f"speed check: {ratios} (within x{self.tolerance:g} either way: profile kept)"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one, else the CPU count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_key(threads: int) -> MachineKey:
    """This machine's key at `threads` torch threads per worker."""
    import torch

    from tandem.engine.profiling.device import cpu_name
    return MachineKey(cpu_name(), usable_cores(), threads, torch.__version__)


def profile_path(model: str | Path, key: MachineKey) -> Path:
    """Where the demo keeps its quick profile of `model` for `key`: one file per thread count and core count."""
    return Path(model) / f"profile-quick-{key.threads}t-{key.cores}c.json"


def sidecar_path(profile: Path) -> Path:
    """Where a cached profile's key and speed baseline are kept."""
    return profile.with_name(profile.stem + ".speed.json")


def speed_verdict(baseline: Sequence[float], now: Sequence[float], kinds: Sequence[str],
                  tolerance: float = SPEED_TOLERANCE) -> SpeedVerdict:
    """The median ratio now/baseline of each kind's steps (`kinds[i]` is step i's kind; 1 for a kind without)."""
    if not len(baseline) == len(now) == len(kinds):
        raise ValueError(f"speed check: {len(baseline)} baseline, {len(now)} timed, {len(kinds)} kinds")
    if any(not t > 0 for t in (*baseline, *now)):
        raise ValueError("speed check: step times must be > 0")
    ratio = {k: statistics.median([n / b for n, b, kk in zip(now, baseline, kinds) if kk == k] or [1.0])
             for k in ("prefill", "decode")}
    return SpeedVerdict(ratio["prefill"], ratio["decode"], tolerance)


def cache_verdict(sidecar: dict | None, key: MachineKey, profile_sha256: str) -> str | None:
    """Why the cached profile cannot be used as it is (None: it can, subject to the speed check)."""
    if not isinstance(sidecar, dict) or sidecar.get("version") != SIDECAR_VERSION:
        return "no speed baseline kept beside it"
    if sidecar.get("profile_sha256") != profile_sha256:
        return "the profile changed since its speed baseline was timed"
    saved = sidecar.get("key")
    if not isinstance(saved, dict):
        return "no machine key kept beside it"
    changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in asdict(key).items() if saved.get(k) != v]
    if changed:
        return "the machine changed: " + ", ".join(changed)
    seconds = sidecar.get("seconds")
    if not (isinstance(seconds, list) and len(seconds) == len(SPEED_POINTS)
            and all(isinstance(s, (int, float)) and s > 0 for s in seconds)):
        return "its speed baseline is not one positive time per checked step"
    return None


class StepTimer:
    """The speed check's harness: the model loaded once at the workers' thread count, SPEED_POINTS timed."""

    def __init__(self, model: str | Path, threads: int, seed: int = 0) -> None:
        import random

        import torch

        from tandem.engine.config import EngineConfig
        from tandem.engine.model_runner import ModelRunner
        from tandem.engine.profiling.grids import Point
        from tandem.engine.profiling.timing import Bench

        self.threads = threads
        self._torch = torch
        with self._at_threads():
            runner = ModelRunner(EngineConfig(model=str(model), num_kv_blocks=SPEED_KV_BLOCKS))
            for t in runner.kv_caches:           # map the pool's pages once: first touches are not step time
                t.fill_(0)
            self.bench = Bench(runner, random.Random(seed))
            self.points = [Point(kind, pf, dec) for kind, pf, dec in SPEED_POINTS]
            for p in self.points:                 # warm-up
                self.bench.run(p)

    @contextlib.contextmanager
    def _at_threads(self) -> Iterator[None]:
        """torch at the workers' thread count inside, its own count restored after."""
        before = self._torch.get_num_threads()
        self._torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            self._torch.set_num_threads(before)

    def times(self, repeats: int = SPEED_REPEATS) -> list[float]:
        """Median seconds of each checked step over `repeats` interleaved passes."""
        runs: list[list[float]] = [[] for _ in self.points]
        with self._at_threads():
            for _ in range(repeats):
                for i, p in enumerate(self.points):
                    runs[i].append(self.bench.run(p))
        return [statistics.median(r) for r in runs]


@dataclass
class CachedProfile:
    """The demo's profile for this run: where it is, the machine it describes, and what the cache check found."""

    path: Path
    key: MachineKey
    notes: list[str]                     # one line each: the speed check, and why it was profiled when it was
    speed: SpeedVerdict | None = None    # None when profiled just now


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_sidecar(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def ensure_profile(model: str | Path, threads: int, max_len: int,
                   log: Callable[[str], None] = lambda _: None) -> CachedProfile:
    """The quick profile of `model` for this machine at `threads` threads per worker: the cached one when its key
    matches and the speed check finds the machine as fast as when it was made, else a new one (`log` says why)."""
    from tandem.engine.profiling import ProfileOptions, profile

    key = machine_key(threads)
    path = profile_path(model, key)
    side = sidecar_path(path)
    saved = _read_sidecar(side)
    reason = "none cached for this machine" if not path.is_file() else cache_verdict(saved, key, _sha256(path))
    timer = StepTimer(model, threads)
    verdict = None
    notes: list[str] = []
    if reason is None:
        verdict = speed_verdict(saved["seconds"], timer.times(), [k for k, _, _ in SPEED_POINTS])
        notes.append(verdict.describe())
        if verdict.stale:
            reason = "the speed check found the machine's speed changed"
    if reason is not None:
        log(f"tandem demo: profiling {model} at {threads} torch thread(s) on {key.cores} core(s) (tandem profile "
            f"--quick; {reason}) ...")
        # the demo serves tp1 workers only: no all-reduce to price, so none is timed (a few seconds saved)
        profile(str(model), ProfileOptions(quick=True, threads=threads, max_len=max_len,
                                           measure_collective=False)).to_json(path)
        side.write_text(json.dumps({"version": SIDECAR_VERSION, "key": asdict(key), "profile_sha256": _sha256(path),
                                    "points": [{"kind": k, "prefills": [list(x) for x in pf], "decodes": list(d)}
                                               for k, pf, d in SPEED_POINTS], "seconds": timer.times()},
                                   indent=1) + "\n")
        notes.append(f"profiled now ({reason})")
    return CachedProfile(path, key, notes, None if reason is not None else verdict)
