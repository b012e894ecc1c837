"""Where measured operator tables come from: the `aiconfigurator-core` package's per-GPU, per-framework data.

Only the package's data files are read (parquet tables under `aiconfigurator_core/systems/data/<system>/<op>/
<framework>/<version>/`); its estimator is not used. A missing package is a `MissingCostData` error whose one line
names the install; nothing here imports pandas or the package at module import time.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PACKAGE = "aiconfigurator-core"
INSTALL_HINT = f"pip install '{PACKAGE}==0.12.0'"
FRAMEWORKS = ("vllm", "sglang", "trtllm")
OPTIONAL_COLUMNS = ("window_size",)   # older tables have no sliding-window column (read as 0: none)
DEFAULT_FRAMEWORK = "vllm"

# tandem's catalogue name -> the package's system directory (GPUs with tables of their own).
SYSTEMS: dict[str, str] = {"h100": "h100_sxm", "h200": "h200_sxm", "a100-80g": "a100_sxm", "l40s": "l40s",
                           "b200": "b200_sxm", "gb200": "gb200"}


class MissingCostData(RuntimeError):
    """The measured cost model was asked for and its data are not here (package absent, or no table)."""


def data_root() -> Path:
    """The package's `systems/data` directory; MissingCostData naming the install when the package is absent."""
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        raise MissingCostData(f"--cost-model measured needs the {PACKAGE} package: {INSTALL_HINT}")
    root = Path(list(spec.submodule_search_locations)[0]) / "systems" / "data"
    if not root.is_dir():
        raise MissingCostData(f"{PACKAGE} is installed but has no systems/data directory at {root}: {INSTALL_HINT}")
    return root


def available() -> bool:
    """Whether the package (and so measured costs) is installed."""
    try:
        data_root()
    except MissingCostData:
        return False
    return True


def system_of(gpu_name: str) -> str | None:
    """The package system directory holding tables for a catalogue GPU, None when it has none."""
    return SYSTEMS.get(gpu_name)


def _version_key(v: str) -> tuple:
    """Sort key of a version string such as 0.5.6.post2 or 1.3.0rc20 (numeric parts numerically)."""
    out = []
    for part in v.replace("rc", ".-1.").replace("post", ".").replace("dev", ".-2.").split("."):
        out.append(int(part) if part.lstrip("-").isdigit() else 0)
    return tuple(out)


@dataclass(frozen=True)
class TableRef:
    """One measured table: its file and where it came from (for reports)."""

    path: Path
    system: str
    op: str
    framework: str
    version: str

    @property
    def label(self) -> str:
        return f"{self.system}/{self.op}/{self.framework}/{self.version}/{self.path.name}"


def find_tables(system: str, op: str, framework: str, filename: str) -> list[TableRef]:
    """Every version of `framework`'s table `filename` of operator family `op` on `system`, newest first."""
    base = data_root() / system / op / framework
    versions = sorted((d.name for d in base.iterdir() if (d / filename).is_file()), key=_version_key) \
        if base.is_dir() else []
    if not versions:
        raise MissingCostData(f"{PACKAGE} has no {op}/{framework}/*/{filename} table for {system}")
    return [TableRef(base / v / filename, system, op, framework, v) for v in reversed(versions)]


def find_table(system: str, op: str, framework: str, filename: str) -> TableRef:
    """The newest version of `framework`'s table `filename` of operator family `op` on `system`."""
    return find_tables(system, op, framework, filename)[0]


_NUMPY_TYPES = {"int64": np.int64, "int32": np.int32, "double": np.float64, "float": np.float32}


def _numpy(column) -> np.ndarray:
    """A pyarrow column as numpy, as `to_numpy(zero_copy_only=False)` gives it, without the pandas import that
    pyarrow's to_numpy makes (~0.25 s of every process that reads a table): numbers without nulls are read-only
    views of the data buffer (no copy: the tables are only read); strings without nulls (read dictionary-encoded, as
    parquet stores them) become an object array of str, each distinct value converted once."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        column = column.unify_dictionaries()
    return _array_numpy(column.combine_chunks())


def _array_numpy(arr) -> np.ndarray:
    """One pyarrow array as numpy (see `_numpy`)."""
    import pyarrow as pa

    dtype = _NUMPY_TYPES.get(str(arr.type))
    if dtype is not None and arr.null_count == 0:
        dtype = np.dtype(dtype)
        return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)
    if pa.types.is_dictionary(arr.type) and pa.types.is_string(arr.type.value_type) and arr.null_count == 0:
        words = np.empty(len(arr.dictionary), dtype=object)
        words[:] = arr.dictionary.to_pylist()
        return words[_array_numpy(arr.indices)]
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_string(arr.type) and arr.null_count == 0:
        out = np.empty(len(arr), dtype=object)
        out[:] = arr.to_pylist()
        return out
    return arr.to_numpy(zero_copy_only=False)


_READ: dict[Path, dict[str, np.ndarray]] = {}       # the columns of each table read so far, least recent first
MAX_TABLES = 64                                     # tables whose columns are kept


def read_columns(path: Path, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Columns of one parquet table as numpy arrays (each column read once per process, whichever callers ask for
    it, for the MAX_TABLES tables read last); a column an older table lacks reads as zeros (window_size 0: no sliding
    window)."""
    have = _READ.get(path, {})
    want = [c for c in dict.fromkeys(columns) if c not in have]
    if want:
        have = {**have, **_read(path, want)}
    _READ.pop(path, None)                           # (re)inserted last: the most recently read
    _READ[path] = have
    while len(_READ) > MAX_TABLES:
        del _READ[next(iter(_READ))]
    return {c: have[c] for c in columns}


def clear_read_cache() -> None:
    """Forget every column read (after the package's data changed on disk)."""
    _READ.clear()


def _read(path: Path, columns: list[str]) -> dict[str, np.ndarray]:
    """Read `columns` of one parquet table (strings dictionary-encoded), checked."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:        # ParquetFile, not read_table: read_table imports pyarrow.dataset and pandas (~0.3 s), for nothing here
        with pq.ParquetFile(path) as f:
            names = set(f.schema_arrow.names)
        there = [c for c in columns if c in names]
        with pq.ParquetFile(path, read_dictionary=there) as f:       # (only string columns read as dictionaries)
            t = f.read(columns=there)
    except (OSError, pa.ArrowException) as e:
        raise MissingCostData(f"{path}: not a readable parquet table ({e}); reinstall with {INSTALL_HINT}") from None
    missing = [c for c in columns if c not in names and c not in OPTIONAL_COLUMNS]
    if missing:
        raise MissingCostData(f"{path}: the table lacks column(s) {', '.join(missing)}; reinstall with {INSTALL_HINT}")
    out = {c: (_numpy(t.column(c)) if c in names else np.zeros(t.num_rows, dtype=np.int64)) for c in columns}
    lat = out.get("latency")
    if lat is not None and lat.dtype.kind not in "fi":
        raise MissingCostData(f"{path}: latencies must be numbers, got {lat.dtype}; reinstall with {INSTALL_HINT}")
    return out


@dataclass(frozen=True)
class CostLabel:
    """Where a worker's step costs come from, for reports: measured, derived or roofline, with the tables read."""

    source: str
    framework: str = ""
    system: str = ""
    donor: str = ""
    tables: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.source == "roofline":
            return "roofline"
        base = f"{self.source} ({self.framework}, {self.system}"
        return base + (f" from {self.donor})" if self.donor else ")")
