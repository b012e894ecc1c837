"""Loaders for the public single-round traces in ../shared/data/traces (Azure 2023, Mooncake, ShareGPT).

Each request becomes a one-round Session. Files are read in place, never copied.
"""
from __future__ import annotations

import csv
import json
import math
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from tandem.workload.arrivals import check_rate, check_seed, poisson_arrivals
from tandem.workload.session import Round, Session, WorkloadError

TRACE_FILES: dict[str, str] = {
    "azure-conv": "AzureLLMInferenceTrace_conv_2023.csv",
    "azure-code": "AzureLLMInferenceTrace_code_2023.csv",
    "mooncake": "mooncake_synthetic_trace.jsonl",
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
}
MOONCAKE_BLOCK_SIZE = 512
SHAREGPT_HEADER = ["num_prefill_tokens", "num_decode_tokens"]  # leading columns of the ShareGPT CSV


def traces_dir() -> Path:
    """The folder holding the trace files: $TANDEM_TRACES_DIR, else <repo root>/../shared/data/traces."""
    env = os.environ.get("TANDEM_TRACES_DIR")
    if env:
        path = Path(env)
        if not path.is_dir():
            raise WorkloadError(f"TANDEM_TRACES_DIR={env!r} is not a directory")
        return path
    path = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
    if not path.is_dir():
        raise WorkloadError(f"trace directory {path} not found; set TANDEM_TRACES_DIR to the folder "
                            f"holding {', '.join(TRACE_FILES.values())}")
    return path


def trace_path(name: str) -> Path:
    """Path of trace `name` ("azure-conv", "azure-code", "mooncake", "sharegpt"), checked to exist."""
    if name not in TRACE_FILES:
        raise WorkloadError(f"unknown trace {name!r} (valid: {', '.join(TRACE_FILES)})")
    path = traces_dir() / TRACE_FILES[name]
    if not path.is_file():
        raise WorkloadError(f"trace file {path} not found")
    return path


def _check_limit(limit: int | None) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1:
        raise WorkloadError(f"limit must be None or an integer >= 1, got {limit!r}")
    return int(limit)


def _read_csv(path: Path, header: list[str], limit: int | None) -> list[list[str]]:
    """Rows of a CSV trace after checking its header; every row must have len(header) fields."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            got = next(reader, None)
            if got is None:
                raise WorkloadError(f"{path}: empty file")
            if got[: len(header)] != header:
                raise WorkloadError(f"{path}:1: expected header {','.join(header)}, got {','.join(got)}")
            rows = []
            for row in reader:
                if not row:
                    continue
                if len(row) < len(header):
                    raise WorkloadError(f"{path}:{reader.line_num}: expected {len(header)} fields, got {len(row)}")
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise WorkloadError(f"{path}: cannot read ({e})") from None
    if not rows:
        raise WorkloadError(f"{path}: no data rows")
    return rows


def _int_column(path: Path, rows: list[list[str]], col: int, name: str, minimum: int) -> np.ndarray:
    try:
        values = np.array([int(r[col]) for r in rows], dtype=np.int64)
    except (ValueError, OverflowError):
        for i, r in enumerate(rows):
            try:
                int(r[col])
            except ValueError:
                raise WorkloadError(f"{path}:{i + 2}: {name} must be an integer, got {r[col]!r}") from None
        raise WorkloadError(f"{path}: {name} out of range") from None
    low = np.flatnonzero(values < minimum)
    if low.size:  # data line numbers assume no blank lines, as in the shipped files
        i = int(low[0])
        raise WorkloadError(f"{path}:{i + 2}: {name} must be >= {minimum}, got {values[i]}")
    return values


def _one_round_sessions(prefix: str, arrivals: list[float], inputs: np.ndarray, outputs: np.ndarray,
                        hash_ids: list | None = None, block_size: int | None = None) -> list[Session]:
    ins, outs = inputs.tolist(), outputs.tolist()
    hs = hash_ids if hash_ids is not None else [None] * len(ins)
    return [Session(f"{prefix}-{i}", t, [Round(a, b, 0.0, h)], None, block_size)
            for i, (t, a, b, h) in enumerate(zip(arrivals, ins, outs, hs))]


def load_azure(kind: str = "conv", limit: int | None = None) -> list[Session]:
    """Azure LLM inference trace 2023 (`kind` "conv" or "code"): real arrival times, one round per request."""
    if kind not in ("conv", "code"):
        raise WorkloadError(f"Azure trace kind must be 'conv' or 'code', got {kind!r}")
    path = trace_path(f"azure-{kind}")
    rows = _read_csv(path, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"], _check_limit(limit))
    try:  # numpy parses ISO timestamps with any number of fractional digits (the file has 7) to ns
        stamps = np.array([r[0].strip().replace(" ", "T") for r in rows], dtype="datetime64[ns]")
    except ValueError:
        raise WorkloadError(f"{path}: unparsable TIMESTAMP (expected like 2023-11-16 18:15:46.6805900)") from None
    if np.isnat(stamps).any():
        raise WorkloadError(f"{path}:{int(np.flatnonzero(np.isnat(stamps))[0]) + 2}: empty TIMESTAMP")
    rel = (stamps - stamps[0]).astype(np.int64) / 1e9
    back = np.flatnonzero(np.diff(rel) < 0)
    if back.size:
        raise WorkloadError(f"{path}:{int(back[0]) + 3}: TIMESTAMP goes backwards")
    inputs = _int_column(path, rows, 1, "ContextTokens", 1)
    outputs = _int_column(path, rows, 2, "GeneratedTokens", 1)
    return _one_round_sessions(f"azure-{kind}", rel.tolist(), inputs, outputs)


def load_mooncake(limit: int | None = None) -> list[Session]:
    """Mooncake synthetic trace: timestamps (ms -> s), lengths, and 512-token prefix block hashes."""
    path = trace_path("mooncake")
    limit = _check_limit(limit)
    times, inputs, outputs, hashes = [], [], [], []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                    t, a, b, h = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
                except ValueError as e:
                    raise WorkloadError(f"{where}: malformed JSON: {getattr(e, 'msg', e)}") from None
                except (KeyError, TypeError) as e:
                    raise WorkloadError(f"{where}: missing field {e} (need timestamp, input_length, "
                                        "output_length, hash_ids)") from None
                if not (type(t) in (int, float) and 0 <= t < math.inf and type(a) is int and a >= 1
                        and type(b) is int and b >= 1 and type(h) is list):
                    raise WorkloadError(f"{where}: need timestamp >= 0, input_length >= 1, output_length >= 1 "
                                        "and a hash_ids list")
                times.append(t)
                inputs.append(a)
                outputs.append(b)
                hashes.append(h)
                if limit is not None and len(times) >= limit:
                    break
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read ({e})") from None
    if not times:
        raise WorkloadError(f"{path}: no data rows")
    t = np.asarray(times, dtype=np.float64) / 1000.0
    return _one_round_sessions("mooncake", (t - t[0]).tolist(), np.asarray(inputs), np.asarray(outputs),
                               hashes, MOONCAKE_BLOCK_SIZE)


def load_sharegpt(limit: int | None = None, rate: float = 1.0, seed: int = 0) -> list[Session]:
    """ShareGPT 8k conversation lengths (Llama-2 tokenizer) with Poisson arrivals at `rate`/s."""
    path = trace_path("sharegpt")
    rate, seed = check_rate(rate), check_seed(seed)
    rows = _read_csv(path, SHAREGPT_HEADER, _check_limit(limit))
    inputs = _int_column(path, rows, 0, "num_prefill_tokens", 1)
    outputs = _int_column(path, rows, 1, "num_decode_tokens", 1)
    arrivals = poisson_arrivals(len(rows), rate, np.random.default_rng(seed)).tolist()
    return _one_round_sessions("sharegpt", arrivals, inputs, outputs)


def sharegpt_file(path: str | os.PathLike | None = None) -> Path:
    """The ShareGPT length statistics CSV: `path` if given (checked to be a file), else the shipped trace."""
    if path is None:
        return trace_path("sharegpt")
    p = Path(path)
    if p.is_dir():
        raise WorkloadError(f"{p}: is a directory, not a ShareGPT length statistics CSV")
    if not p.is_file():
        raise WorkloadError(f"{p}: no such file (expected a ShareGPT length statistics CSV with columns "
                            "num_prefill_tokens,num_decode_tokens)")
    return p


def sharegpt_lengths(path: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Columns num_prefill_tokens and num_decode_tokens (both >= 1) of the ShareGPT length statistics CSV
    (`path`, default the shipped trace), read once per file version; read-only arrays in file order.

    A missing or malformed file is a WorkloadError with a one-line message naming the file (and line)."""
    p = sharegpt_file(path)
    try:
        st = p.stat()
    except OSError as e:
        raise WorkloadError(f"{p}: cannot read ({e.strerror})") from None
    return _sharegpt_columns(str(p), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=4)
def _sharegpt_columns(path: str, mtime_ns: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The two columns of one version (mtime, size) of the file: an edited file is read again."""
    p = Path(path)
    rows = _read_csv(p, SHAREGPT_HEADER, None)
    prefill = _int_column(p, rows, 0, "num_prefill_tokens", 1)
    decode = _int_column(p, rows, 1, "num_decode_tokens", 1)
    prefill.setflags(write=False)
    decode.setflags(write=False)
    return prefill, decode


_LOADERS = {
    "azure-conv": (lambda **kw: load_azure("conv", **kw), ("limit",)),
    "azure-code": (lambda **kw: load_azure("code", **kw), ("limit",)),
    "mooncake": (load_mooncake, ("limit",)),
    "sharegpt": (load_sharegpt, ("limit", "rate", "seed")),
}


def load_trace(name: str, **kw) -> list[Session]:
    """Load trace `name` ("azure-conv", "azure-code", "mooncake", "sharegpt") with that loader's options."""
    if name not in _LOADERS:
        raise WorkloadError(f"unknown trace {name!r} (valid: {', '.join(_LOADERS)})")
    loader, allowed = _LOADERS[name]
    unknown = sorted(set(kw) - set(allowed))
    if unknown:
        raise WorkloadError(f"trace {name!r} takes options {', '.join(allowed)}; got unknown {', '.join(unknown)}")
    return loader(**kw)
