"""The `dllm_latency` section of a profile: Optimus's T(c, b) measured by `tandem profile` on a block-diffusion engine.

The samples (b windows of c positions over a cached context, seconds each) and the piecewise-affine fit in b·c
(breakpoints, per-regime (β0, β1), the floor) that `tandem.policy.optimus.latency.ChunkLatency` takes as its fields.
Plain data, free of torch and of the policy layer, so the simulator and the engine both read it; the section carries
its own version, and a profile without it (every profile of an autoregressive model, every older one) still loads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

SECTION = "dllm_latency"
SECTION_VERSION = 1


def _num(v: Any, what: str) -> float:
    """A finite number or ValueError naming `what`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number, got {v!r}")
    return float(v)


@dataclass
class WindowLatencyProfile:
    """T(c, b) ≈ β1_k·b·c + β0_k + α·b in regime k (breakpoints in b·c), floored, plus the head per sampled row, with
    the samples it was fitted to."""

    breakpoints: tuple[float, ...]
    coefs: tuple[tuple[float, float], ...]
    floor_s: float
    block: int                                  # the diffusion block length windows were cut from
    context: int                                # cached tokens each window read
    samples: list[dict] = field(default_factory=list)   # split, c, b, tokens, seconds, runs, predicted
    train_error: dict = field(default_factory=dict)
    heldout_error: dict = field(default_factory=dict)
    per_seq_s: float = 0.0                      # α: seconds per sequence in a step (absent in older sections: 0)
    head_s: float = 0.0                         # LM head and sampling per sampled row, outside the regimes (absent
                                                # in older sections: 0, the regimes include it for every row)

    def to_dict(self) -> dict:
        """The JSON section."""
        return {"version": SECTION_VERSION, "block": self.block, "context": self.context,
                "fit": {"breakpoints": list(self.breakpoints), "coefs": [list(c) for c in self.coefs],
                        "floor_s": self.floor_s, "per_seq_s": self.per_seq_s, "head_s": self.head_s},
                "train_error": self.train_error, "heldout_error": self.heldout_error, "samples": self.samples}

    @classmethod
    def from_dict(cls, d: Any) -> WindowLatencyProfile:
        """Parse and validate; ValueError with one line naming the section and what is wrong."""
        try:
            return cls._parse(d)
        except ValueError as e:
            raise ValueError(f"profile section {SECTION}: {e}") from None
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            what = f"missing field {e.args[0]!r}" if isinstance(e, KeyError) else f"malformed ({e})"
            raise ValueError(f"profile section {SECTION}: {what}") from None

    @classmethod
    def _parse(cls, d: Any) -> WindowLatencyProfile:
        if not isinstance(d, Mapping):
            raise ValueError(f"expected an object, got {type(d).__name__}")
        if d.get("version") != SECTION_VERSION:
            raise ValueError(f"version {d.get('version')!r} is not supported; expected {SECTION_VERSION}")
        fit = d["fit"]
        bps = tuple(_num(v, "fit.breakpoints") for v in fit["breakpoints"])
        if any(not isinstance(c, (list, tuple)) or len(c) != 2 for c in fit["coefs"]):
            raise ValueError("fit.coefs must be [beta0, beta1] pairs")
        coefs = tuple((_num(c[0], "fit.coefs"), _num(c[1], "fit.coefs")) for c in fit["coefs"])
        if len(coefs) != len(bps) + 1 or list(bps) != sorted(bps):
            raise ValueError(f"fit needs sorted breakpoints and one more regime than breakpoints, got {len(bps)} "
                             f"breakpoint(s) and {len(coefs)} regime(s)")
        floor = _num(fit["floor_s"], "fit.floor_s")
        if floor < 0:
            raise ValueError(f"fit.floor_s must be >= 0, got {floor}")
        per_seq = _num(fit.get("per_seq_s", 0.0), "fit.per_seq_s")
        if per_seq < 0:
            raise ValueError(f"fit.per_seq_s must be >= 0, got {per_seq}")
        head = _num(fit.get("head_s", 0.0), "fit.head_s")
        if head < 0:
            raise ValueError(f"fit.head_s must be >= 0, got {head}")
        block, context = d["block"], d["context"]
        if not (isinstance(block, int) and block >= 1 and isinstance(context, int) and context >= 0):
            raise ValueError(f"block must be an integer >= 1 and context >= 0, got {block!r} and {context!r}")
        samples = list(d.get("samples", []))
        for s in samples:
            for k in ("c", "b", "seconds"):
                if _num(s[k], f"samples[].{k}") <= 0:
                    raise ValueError(f"samples[].{k} must be > 0, got {s[k]!r}")
        return cls(bps, coefs, floor, block, context, samples, dict(d.get("train_error") or {}),
                   dict(d.get("heldout_error") or {}), per_seq, head)

    def points(self, split: str) -> tuple[list[int], list[int], list[float]]:
        """(c, b, seconds) of the samples of one split (train or heldout)."""
        sel = [s for s in self.samples if s.get("split") == split]
        return [int(s["c"]) for s in sel], [int(s["b"]) for s in sel], [float(s["seconds"]) for s in sel]


__all__ = ["SECTION", "SECTION_VERSION", "WindowLatencyProfile"]
