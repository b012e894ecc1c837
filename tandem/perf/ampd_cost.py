"""AMPD's three time-cost functions (§3) as piecewise alpha-beta fits.

    T_pre(l_hist, l_incr; tp)    features [1, l_incr, l_incr*l_hist + l_incr^2/2, l_hist], key l_incr
    T_dec(b; tp) (and context)   features [1, b, ctx_tokens],                              key b
    T_kv(l; tp_src, tp_dst)      features [1, l] (pure alpha-beta, one segment)

The T_pre features are the work of a prefill: a constant (weights streamed, launch overhead),
linear work per new token, causal attention pairs (l_incr*l_hist + l_incr^2/2) and history KV
read. T_dec: constant, per-sequence work and context read by attention. Breaking the key
feature into segments captures the memory-bound -> compute-bound transition.

Built either from the roofline (`from_roofline`: sample a grid, fit) or from measurements
(`from_samples`, used by the profiler); the same fitting code serves both.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from tandem.perf.fit import PiecewiseLinear, fit
from tandem.perf.hardware import GPU, get_gpu
from tandem.perf.models import ModelSpec, get_model
from tandem.perf.roofline import Roofline, kv_capacity_tokens, kv_transfer_time, supported_tps
from tandem.perf.errors import DoesNotFitError, ParallelismError
from tandem.perf.step_timer import StepTimer

# Context per decode sequence assumed by t_dec when the caller does not give the total.
# Multi-round agent sessions (ToolBench, GAIA in AMPD §7) carry a few thousand tokens of history.
TYPICAL_CTX = 4096
PRE_SEGMENTS = 3
DEC_SEGMENTS = 3
FORMAT_VERSION = 1

Samples = tuple[Sequence[Sequence[float]], Sequence[float]]  # (feature rows, seconds)
Fitted = tuple[PiecewiseLinear, float]                      # a fit and its training median relative error


def pre_features(l_hist: float, l_incr: float) -> tuple[float, float, float, float]:
    return (1.0, float(l_incr), l_incr * l_hist + l_incr * l_incr / 2, float(l_hist))


def dec_features(batch: float, ctx_tokens: float) -> tuple[float, float, float]:
    return (1.0, float(batch), float(ctx_tokens))


def kv_features(tokens: float) -> tuple[float, float]:
    return (1.0, float(tokens))


def _kv_key(src_tp: int, dst_tp: int, same_node: bool) -> str:
    return f"{src_tp}-{dst_tp}-{'node' if same_node else 'net'}"


class AMPDCostModel:
    """T_pre, T_dec, T_kv per tensor-parallel degree. Immutable once built (instances built by
    `from_roofline` are cached and shared)."""

    __slots__ = ("pre", "dec", "kv", "typical_ctx", "meta")

    def __init__(self, pre: Mapping[int, PiecewiseLinear], dec: Mapping[int, PiecewiseLinear],
                 kv: Mapping[str, PiecewiseLinear], typical_ctx: int = TYPICAL_CTX, meta: dict | None = None):
        self.pre = dict(pre)
        self.dec = dict(dec)
        self.kv = dict(kv)
        self.typical_ctx = typical_ctx
        self.meta = dict(meta or {})

    @property
    def tps(self) -> tuple[int, ...]:
        return tuple(sorted(self.pre))

    # --- the three cost functions (hot path) ------------------------------------------------
    def t_pre(self, l_hist: float, l_incr: float, tp: int) -> float:
        """Seconds to prefill l_incr new tokens after l_hist tokens of history on a tp worker."""
        if l_incr <= 0:
            return 0.0
        f = self.pre.get(tp) or self._missing("t_pre", tp)
        return f.predict((1.0, l_incr, l_incr * l_hist + l_incr * l_incr / 2, l_hist))

    def t_dec(self, batch: int, tp: int, ctx_tokens: float | None = None) -> float:
        """Seconds of one decode iteration of `batch` sequences (contexts summing to ctx_tokens;
        batch x typical_ctx when not given)."""
        if batch <= 0:
            return 0.0
        f = self.dec.get(tp) or self._missing("t_dec", tp)
        return f.predict((1.0, batch, batch * self.typical_ctx if ctx_tokens is None else ctx_tokens))

    def t_kv(self, tokens: float, src_tp: int, dst_tp: int, same_node: bool = False) -> float:
        """Seconds to move the KV of `tokens` tokens from a src_tp worker to a dst_tp worker."""
        if tokens <= 0:
            return 0.0
        f = self.kv.get(_kv_key(src_tp, dst_tp, same_node))
        if f is None:
            raise ParallelismError(f"no T_kv fit for tp{src_tp} -> tp{dst_tp} ({'same node' if same_node else 'across nodes'}); "
                                   f"fitted: {', '.join(sorted(self.kv))}")
        return f.predict((1.0, tokens))

    def _missing(self, what: str, tp: int):
        raise ParallelismError(f"no {what} fit for tp{tp}; fitted degrees: {', '.join(f'tp{t}' for t in self.tps)}")

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_samples(cls, pre: Mapping[int, Samples], dec: Mapping[int, Samples],
                     kv: Mapping[tuple[int, int, bool], Samples] | None = None, *,
                     pre_segments: int | Sequence[float] = PRE_SEGMENTS,
                     dec_segments: int | Sequence[float] = DEC_SEGMENTS,
                     typical_ctx: int = TYPICAL_CTX, meta: dict | None = None) -> "AMPDCostModel":
        """Fit from (features, seconds) samples: `pre[tp]` rows are `pre_features(...)`,
        `dec[tp]` rows `dec_features(...)`, `kv[(src_tp, dst_tp, same_node)]` rows
        `kv_features(...)`. Training median relative errors are stored in meta["fit_error"]."""
        pre_f = {tp: _fitted(X, y, pre_segments) for tp, (X, y) in pre.items()}
        dec_f = {tp: _fitted(X, y, dec_segments) for tp, (X, y) in dec.items()}
        kv_f = {_kv_key(*k): _fitted(X, y, []) for k, (X, y) in (kv or {}).items()}   # alpha-beta: one segment
        return cls.from_fits(pre_f, dec_f, kv_f, typical_ctx=typical_ctx, meta=meta)

    @classmethod
    def from_fits(cls, pre: Mapping[int, Fitted], dec: Mapping[int, Fitted], kv: Mapping[str, Fitted], *,
                  typical_ctx: int = TYPICAL_CTX, meta: dict | None = None) -> "AMPDCostModel":
        """From fits already made, each with its training median relative error (kept in meta["fit_error"])."""
        meta = dict(meta or {})
        err = {**{f"pre/tp{tp}": e for tp, (_, e) in pre.items()}, **{f"dec/tp{tp}": e for tp, (_, e) in dec.items()},
               **{f"kv/{k}": e for k, (_, e) in kv.items()}}
        meta.setdefault("source", "samples")
        meta["fit_error"] = err
        return cls({tp: f for tp, (f, _) in pre.items()}, {tp: f for tp, (f, _) in dec.items()},
                   {k: f for k, (f, _) in kv.items()}, typical_ctx, meta)

    @classmethod
    def from_roofline(cls, model: ModelSpec | str, gpu: GPU | str, tps: Sequence[int] | None = None,
                      typical_ctx: int = TYPICAL_CTX, chunk_tokens: int | None = None) -> "AMPDCostModel":
        """Sample the roofline on a grid and fit. tps=None: every power-of-two degree up to one
        node that the model's heads divide (supported_tps). Cached per arguments in-process."""
        model, gpu = get_model(model), get_gpu(gpu)
        tps = supported_tps(model, gpu) if tps is None else tuple(int(t) for t in tps)
        return from_roofline_cached(model, gpu, tps, typical_ctx, chunk_tokens)

    # --- persistence --------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "typical_ctx": self.typical_ctx, "meta": self.meta,
                "pre": {str(tp): f.to_dict() for tp, f in sorted(self.pre.items())},
                "dec": {str(tp): f.to_dict() for tp, f in sorted(self.dec.items())},
                "kv": {k: f.to_dict() for k, f in sorted(self.kv.items())}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "AMPDCostModel":
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"AMPD cost model format version {d.get('version')!r} is not supported; expected {FORMAT_VERSION}")
        return cls({int(tp): PiecewiseLinear.from_dict(f) for tp, f in d["pre"].items()},
                   {int(tp): PiecewiseLinear.from_dict(f) for tp, f in d["dec"].items()},
                   {k: PiecewiseLinear.from_dict(f) for k, f in d.get("kv", {}).items()},
                   int(d.get("typical_ctx", TYPICAL_CTX)), d.get("meta", {}))

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "AMPDCostModel":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def __repr__(self) -> str:
        who = " ".join(str(self.meta[k]) for k in ("model", "gpu") if k in self.meta)
        return f"AMPDCostModel({who}, tps={self.tps})"


# --- roofline sampling grids ------------------------------------------------------------------
# l_incr: 1 .. 128K log-spaced (2 points per octave); l_hist: 0 and 256 .. 128K by octaves,
# keeping l_hist + l_incr within the model's context. Decode: batch 1 .. 512 log-spaced,
# per-sequence context 128 .. 32K by octaves, within the worker's KV capacity when it fits.
_L_INCR = sorted({int(round(v)) for v in np.geomspace(1, 131072, 35)})
_L_HIST = [0] + [256 << i for i in range(10)]
_BATCH = sorted({int(round(v)) for v in np.geomspace(1, 512, 28)})
_CTX = [128 << i for i in range(9)]


def roofline_pre_samples(roof: StepTimer, chunk_tokens: int | None = None) -> Samples:
    X, y = [], []
    cap = roof.model.max_context
    for lh in _L_HIST:
        for li in _L_INCR:
            if lh + li > cap:
                continue
            X.append(pre_features(lh, li))
            y.append(roof.prefill_time(lh, li, chunk_tokens))
    return X, y


def roofline_dec_samples(roof: StepTimer) -> Samples:
    try:
        cap = kv_capacity_tokens(roof.model, roof.gpu, roof.tp)
    except DoesNotFitError:
        cap = math.inf  # still give times; whether it fits is the planner's question
    X, y = [], []
    for c in _CTX:
        if c > roof.model.max_context:
            continue
        for b in _BATCH:
            if b * c > cap and b > 1:
                continue
            X.append(dec_features(b, b * c))
            y.append(roof.decode_time(b, b * c))
    return X, y


def _kv_samples(model: ModelSpec, gpu: GPU, src: int, dst: int, same: bool) -> Samples:
    toks = [1, 16, 256, 4096, 65536, 131072]
    return [kv_features(t) for t in toks], [kv_transfer_time(model, gpu, t, src, dst, same) for t in toks]


@lru_cache(maxsize=64)
def from_roofline_cached(model: ModelSpec, gpu: GPU, tps: tuple[int, ...], typical_ctx: int,
                          chunk_tokens: int | None) -> AMPDCostModel:
    return from_timers({tp: Roofline(model, gpu, tp) for tp in tps}, typical_ctx, chunk_tokens, "roofline")


def from_timers(timers: Mapping[int, StepTimer], typical_ctx: int = TYPICAL_CTX, chunk_tokens: int | None = None,
                source: str = "roofline") -> AMPDCostModel:
    """AMPD's T_pre / T_dec fitted to samples of one step timer per tp (a Roofline or a MeasuredStep: anything with
    model, gpu, tp, prefill_time and decode_time); T_kv from the alpha-beta link model."""
    any_timer = next(iter(timers.values()))
    model, gpu, tps = any_timer.model, any_timer.gpu, tuple(sorted(timers))
    fits = {tp: timer_fits(r, chunk_tokens) for tp, r in timers.items()}
    pre, dec = {tp: f[0] for tp, f in fits.items()}, {tp: f[1] for tp, f in fits.items()}
    kv = {_kv_key(s, d, same): _kv_fit(model, gpu, s, d, same) for s in tps for d in tps for same in (True, False)}
    meta = {"source": source, "model": model.name, "gpu": gpu.name, "chunk_tokens": chunk_tokens}
    return AMPDCostModel.from_fits(pre, dec, kv, typical_ctx=typical_ctx, meta=meta)


def _fitted(X, y, segments: int | Sequence[float]) -> Fitted:
    f = fit(X, y, key=1, breakpoints=segments)
    return f, f.median_rel_error(X, y)


@lru_cache(maxsize=128)
def timer_fits(timer: StepTimer, chunk_tokens: int | None) -> tuple[Fitted, Fitted]:
    """T_pre and T_dec fitted to one step timer's samples (cached per timer: a planner builds the routing costs of
    many combinations of the same few degrees, and each degree's fits are the same in every one)."""
    return (_fitted(*roofline_pre_samples(timer, chunk_tokens), PRE_SEGMENTS),
            _fitted(*roofline_dec_samples(timer), DEC_SEGMENTS))


@lru_cache(maxsize=256)
def _kv_fit(model: ModelSpec, gpu: GPU, src: int, dst: int, same: bool) -> Fitted:
    return _fitted(*_kv_samples(model, gpu, src, dst, same), [])
