"""Measurements cached in memory and on disk, keyed on the run and a hash of the simulator's source code."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

from tandem.plan.coefficients.measurement import Measurement
from tandem.plan.coefficients.workload import SimSpec

CACHE_VERSION = 1


def default_cache_dir() -> Path:
    """~/.cache/tandem/plan (or $XDG_CACHE_HOME/tandem/plan)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "plan"


@lru_cache(maxsize=1)
def code_hash() -> str:
    """Hash of the sources whose behaviour a cached run depends on."""
    import tandem
    root = Path(tandem.__file__).resolve().parent
    h = hashlib.sha256(str(CACHE_VERSION).encode())
    for sub in ("core", "perf", "policy", "sim", "workload"):
        for p in sorted((root / sub).glob("*.py")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    for p in sorted((root / "plan" / "coefficients").glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


class RunCache:
    """Measurements by run key, in memory and (unless `directory` is None) as JSON files on disk."""

    def __init__(self, directory: str | os.PathLike | None):
        self.dir = Path(directory) if directory is not None else None
        self.mem: dict[str, Measurement] = {}

    def key(self, spec: SimSpec, workload_key: str, deploy: str) -> str:
        text = json.dumps({"v": CACHE_VERSION, "code": code_hash(), "model": spec.model, "gpu": spec.gpu,
                           "policy": spec.policy, "seed": spec.seed, "sim": [list(kv) for kv in spec.sim],
                           "workload": workload_key, "deploy": deploy}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.json"

    def get(self, key: str) -> Measurement | None:
        m = self.mem.get(key)
        if m is None and self.dir is not None:
            try:
                m = Measurement.from_dict(json.loads(self._path(key).read_text()))
            except (OSError, ValueError, TypeError):
                return None
            self.mem[key] = m
        return m

    def put(self, key: str, m: Measurement) -> None:
        old = self.get(key)
        if old is not None and (old.exact or (not m.exact and old.z >= m.z)):
            return
        self.mem[key] = m
        if self.dir is None:
            return
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(dataclasses.replace(m, cached=False).to_dict()))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only or full cache never stops planning


def usable(m: Measurement | None, cutoff: float) -> Measurement | None:
    """A cached measurement answers a request when it is exact, or a bound at least as high as the cutoff."""
    if m is None:
        return None
    if m.exact or m.z >= cutoff:
        return dataclasses.replace(m, cached=True)
    return None
