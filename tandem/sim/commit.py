"""How many tokens a simulated multi-token decode step commits per sequence (diffusion / speculative steps
commit 0..query_tokens): a seeded draw, so the core's multi-token accounting runs at cluster scale."""
from __future__ import annotations

import random

from tandem.core.types import StepPlan


class UniformCommit:
    """Each decoding sequence commits an integer drawn uniformly from [lo, hi], capped by its query tokens."""

    def __init__(self, lo: int, hi: int, seed: int = 0) -> None:
        if not 0 <= lo <= hi or hi < 1:
            raise ValueError(f"commit range must satisfy 0 <= lo <= hi and hi >= 1, got [{lo}, {hi}]")
        self.lo, self.hi = lo, hi
        self.rng = random.Random(seed ^ 0xC0111717)

    def __call__(self, plan: StepPlan) -> dict[str, int] | None:
        if not plan.decode:
            return None
        r = self.rng.randint
        return {s.session_id: min(s.query_tokens, r(self.lo, self.hi)) for s in plan.decode}
