"""The coefficients of one simulated deployment (Measurement): its objective and what the plan reports beside it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class Measurement:
    """One simulated deployment: its objective and what the plan reports beside it."""

    deploy: str
    exact: bool                      # False: the run stopped early, `z` is a lower bound (the cutoff)
    z: float                         # max(ttft_norm, itl_norm)
    ttft_norm: float | None = None   # P95 of TTFT / TTFT SLO
    itl_norm: float | None = None    # P95 of round mean ITL / ITL SLO
    ttft_p95_s: float | None = None  # P95 TTFT, seconds (same rounds)
    itl_p95_s: float | None = None   # P95 round mean ITL, seconds
    slo_attainment: float | None = None
    round_slo_attainment: float | None = None
    local_prefill_fraction: float | None = None
    sessions_failed: int = 0
    events: int = 0
    wall_s: float = 0.0
    cached: bool = False

    @property
    def bottleneck(self) -> str:
        """'prefill' when TTFT sets Z, 'decode' when ITL does."""
        if self.ttft_norm is None or self.itl_norm is None:
            return "?"
        return "prefill" if self.ttft_norm >= self.itl_norm else "decode"

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Measurement":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
