"""How many tokens a simulated multi-token decode step commits per sequence (diffusion / speculative steps
commit 0..query_tokens): a seeded draw, so the core's multi-token accounting runs at cluster scale."""
from __future__ import annotations

import math
import random

from tandem.core.types import StepPlan
from tandem.perf.dllm import REQUEST_CONCENTRATION, StretchModel


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
        return {s.session_id: min(s.commit_cap, r(self.lo, self.hi)) for s in plan.decode}


class StretchCommit:
    """Block-diffusion commits drawn from a StretchModel (tandem.perf.dllm): each session draws how predictable it
    is (π_r ~ Beta around the dataset's π), each step a stretch L, and a window commits min(L, its commit cap).

    Common random numbers: every session draws its π and its stretches from its own stream, seeded by the run's
    seed and its id, so two policies simulated on the same sessions give each session the same π and the same k-th
    stretch; their difference is the policy's, not the luck of the draw (with one shared stream, a policy that took
    other steps handed the sessions other π's: the same fixed chunk moved by 3% between seeds, elastic by 11%)."""

    def __init__(self, model: StretchModel, seed: int = 0, concentration: float = REQUEST_CONCENTRATION) -> None:
        self.model = model
        self.kappa = concentration
        self.seed = seed
        self._sessions: dict[str, tuple[float, random.Random]] = {}
        self._log_q = math.log(1.0 - model.p) if model.p < 1.0 else -math.inf

    def _session(self, sid: str) -> tuple[float, random.Random]:
        """The session's π and its stream of stretches (drawn once, from its own seeded stream)."""
        st = self._sessions.get(sid)
        if st is None:
            rng = random.Random(f"stretch:{self.seed}:{sid}")
            m = self.model.pi
            pi = (rng.betavariate(self.kappa * m, self.kappa * (1.0 - m)) if 0.0 < m < 1.0
                  else m)                 # π = 0: one token every step; π = 1: always a stretch
            st = self._sessions[sid] = (pi, rng)
        return st

    def session_pi(self, sid: str) -> float:
        """The session's chance of a predictable stretch at a step (drawn once)."""
        return self._session(sid)[0]

    def stretch(self, sid: str) -> int:
        """Positions the session's next step could commit with an unbounded window."""
        pi, rng = self._session(sid)
        if rng.random() >= pi:
            return 1
        if self._log_q == -math.inf:
            return 1
        return 1 + int(math.log(1.0 - rng.random()) / self._log_q)   # 1 + Geometric(p) failures

    def __call__(self, plan: StepPlan) -> dict[str, int] | None:
        if not plan.decode:
            return None
        out = {}
        for s in plan.decode:
            n = self.stretch(s.session_id)
            out[s.session_id] = n if n < s.commit_cap else s.commit_cap
        return out
