"""The all-reduce cost of a tensor-parallel worker, measured on the profiled host, and the step timer that prices a
tp-N step from a tp1 profile with it.

`tandem profile` times gloo (CPU) or NCCL (CUDA) all-reduces among N processes of this host at several sizes and fits
seconds = latency + bytes x per-byte (non-negative, on relative error, as every fit in tandem). It also counts the
all-reduces one engine step makes from the model it loaded (each row-parallel linear and the vocabulary-parallel
embedding sums its output once: 2 per layer + 1), each of the step's query tokens x hidden x dtype bytes.

`ShardedStepTimer` prices a tp-N step from the tp1 step model: the terms of the work the ranks split (per query
token: the linear layers; attention pairs, KV reads) divided by N, the per-step and per-sequence terms (Python,
sampling on the driver, the attention call) kept whole, plus the step's all-reduces from the fit. The rule is fixed
here, not fitted to a tp-N measurement: `benchmarks/tp_cpu.py` reports how far it is from what tp-N measures.
Torch-free: the simulator reads it.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from tandem.perf.nonneg import nonneg_lstsq
from tandem.perf.step_timer import StepTimer

# Indices in the step model's FEATURES of the terms the ranks split (tokens, prefill_attn_pairs,
# prefill_kv_read_tokens, decode_ctx_tokens); const, prefill_chunks and decode_seqs are paid whole.
SHARDED_FEATURES = (1, 4, 5, 6)


@dataclass(frozen=True)
class AllReduceFit:
    """Seconds of one all-reduce among `ranks` processes: latency_s + bytes x per_byte_s, fitted to samples."""

    ranks: int
    latency_s: float
    per_byte_s: float
    samples: tuple[tuple[int, float], ...] = ()       # (bytes, median seconds) measured

    def seconds(self, nbytes: float) -> float:
        """One all-reduce of `nbytes` (0 bytes: no call)."""
        return self.latency_s + nbytes * self.per_byte_s if nbytes > 0 else 0.0

    @classmethod
    def from_samples(cls, ranks: int, samples: Sequence[tuple[int, float]]) -> "AllReduceFit":
        """Non-negative latency and per-byte cost on relative error; ValueError without two distinct sizes."""
        xs = np.asarray([float(b) for b, _ in samples])
        ys = np.asarray([float(s) for _, s in samples])
        if len(set(xs.tolist())) < 2 or np.any(ys <= 0) or np.any(xs <= 0):
            raise ValueError("an all-reduce fit needs positive times at two or more positive sizes")
        a = np.stack([np.ones_like(xs), xs], axis=1) / ys[:, None]
        (lat, per), _ = nonneg_lstsq(a, np.ones_like(ys))
        return cls(int(ranks), float(lat), float(per), tuple((int(b), float(s)) for b, s in samples))

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "latency_s": self.latency_s, "per_byte_s": self.per_byte_s,
                "samples": [list(s) for s in self.samples]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "AllReduceFit":
        fit = cls(int(d["ranks"]), float(d["latency_s"]), float(d["per_byte_s"]),
                  tuple((int(b), float(s)) for b, s in d.get("samples", ())))
        if fit.ranks < 2 or fit.latency_s < 0 or fit.per_byte_s < 0:
            raise ValueError(f"collective fit needs ranks >= 2 and non-negative costs, got {d}")
        return fit


@dataclass
class CollectiveCost:
    """What a profile measured of the collectives: the engine's all-reduces per step, their bytes per query token,
    and one fit per rank count. `in_steps`: at tp>1, the time and count of the all-reduces the profiled steps made."""

    all_reduces_per_step: int
    bytes_per_token: int
    backend: str
    fits: dict[int, AllReduceFit] = field(default_factory=dict)
    in_steps: dict | None = None

    def step_seconds(self, tokens: float, ranks: int) -> float:
        """The all-reduces of one step of `tokens` query tokens on `ranks` ranks (0 at one rank)."""
        if ranks == 1:
            return 0.0
        return self.all_reduces_per_step * self.fits[ranks].seconds(tokens * self.bytes_per_token)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "all_reduces_per_step": self.all_reduces_per_step,
                "bytes_per_token": self.bytes_per_token, "fits": [f.to_dict() for _, f in sorted(self.fits.items())],
                "in_steps": self.in_steps}

    @classmethod
    def from_dict(cls, d: Mapping) -> "CollectiveCost":
        fits = [AllReduceFit.from_dict(f) for f in d.get("fits", ())]
        c = cls(int(d["all_reduces_per_step"]), int(d["bytes_per_token"]), str(d.get("backend", "?")),
                {f.ranks: f for f in fits}, dict(d["in_steps"]) if d.get("in_steps") is not None else None)
        if c.all_reduces_per_step < 0 or c.bytes_per_token < 1:
            raise ValueError(f"collective needs all_reduces_per_step >= 0 and bytes_per_token >= 1, got {dict(d)}")
        return c


class ShardedStepTimer(StepTimer):
    """A tp-N step priced from a tp1 step model (coefficients per segment, keyed on query tokens) and the measured
    all-reduces (module doc). The segment is the one the step's query tokens pick: the ranks run the same rows."""

    __slots__ = ("base", "ranks", "collective", "max_num_batched_tokens")

    def __init__(self, base, ranks: int, collective: CollectiveCost) -> None:
        if ranks not in collective.fits:
            raise ValueError(f"no all-reduce fit for {ranks} ranks")
        self.base = base                   # a StepTimeModel (fit: PiecewiseLinear over FEATURES)
        self.ranks = int(ranks)
        self.collective = collective
        self.max_num_batched_tokens = base.max_num_batched_tokens

    def step_time_args(self, prefill_tokens: float, prefill_attn_pairs: float, prefill_kv_read_tokens: float,
                       num_prefill: float, num_decode: float, decode_ctx_tokens: float, graph: bool = False,
                       decode_kv_shared: float = 0) -> float:
        tokens = prefill_tokens + num_decode
        if tokens <= 0:
            return 0.0
        x = [1.0, tokens, num_prefill, num_decode, prefill_attn_pairs, prefill_kv_read_tokens, decode_ctx_tokens]
        for i in SHARDED_FEATURES:
            x[i] /= self.ranks
        pw = self.base.fit
        c = pw.coefs[bisect_right(pw.breakpoints, tokens)]
        return sum(a * b for a, b in zip(c, x)) + self.collective.step_seconds(tokens, self.ranks)

    def prefill_time(self, l_hist: int, l_incr: int, chunk_tokens: int | None = None) -> float:
        """A prefill alone, in chunks of the profiled engine's max_num_batched_tokens."""
        return super().prefill_time(l_hist, l_incr, chunk_tokens or self.max_num_batched_tokens)


__all__ = ["AllReduceFit", "CollectiveCost", "ShardedStepTimer", "SHARDED_FEATURES"]
