"""How many tokens a block-diffusion step commits: Optimus Table 2 and a distribution that reproduces it.

Optimus (Table 2) reports, per dataset and model, the mean and standard deviation of the tokens a BD32 step commits
per sequence (threshold 0.9, block 32): SDAR-8B 1.9-6.1 a step with a spread larger than the mean (most steps commit
one token, some commit long predictable stretches). `StretchModel` is the distribution the simulator draws from:
at every step the model can fill a stretch of L positions ahead of its decoded prefix, L = 1 with probability 1 − π
and 1 + Geometric (mean m − 1 more) with probability π; a window of c positions commits min(L, c). The two
parameters (π, m) are solved so that min(L, 32) has the table's mean and standard deviation; the dependence on c
(diminishing returns: E[min(L, c)] is concave in c) then follows from the same L, and docs/diffusion.md compares it
with the commits measured on the project's trained tiny model. Each request draws its own π_r from a Beta around π
(requests differ in how predictable they are) without changing the dataset's moments at block 32 (the moments are
linear in π).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.perf.errors import unknown_name

TABLE2_BLOCK = 32
# Optimus Table 2: BD32 tokens committed per step, mean (std), per dataset, for SDAR-8B and LLaDA2.0-16B.
OPTIMUS_TABLE2: dict[str, dict[str, tuple[float, float]]] = {
    "sdar-8b": {"sharegpt": (5.29, 9.44), "lmsys-chat": (4.81, 8.80), "longbench": (6.06, 10.74),
                "gsm8k": (3.20, 5.68), "humaneval": (3.75, 5.96), "mbpp": (1.96, 3.33), "ifeval": (1.88, 3.90)},
    "llada2.0-16b": {"sharegpt": (2.51, 4.19), "lmsys-chat": (2.52, 4.84), "longbench": (1.63, 1.90),
                     "gsm8k": (2.61, 4.07), "humaneval": (6.01, 8.51), "mbpp": (3.34, 4.81), "ifeval": (1.28, 1.74)},
}
# Optimus Table 2: the datasets' input and output lengths, mean (std) in tokens.
OPTIMUS_LENGTHS: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "sharegpt": ((213, 508), (321, 214)), "lmsys-chat": ((89, 133), (183, 163)),
    "longbench": ((4015, 2057), (116, 138)), "gsm8k": ((89, 22), (175, 67)), "humaneval": ((172, 65), (103, 62)),
    "mbpp": ((155, 77), (49, 28)), "ifeval": ((58, 24), (281, 264)),
}
REQUEST_CONCENTRATION = 8.0     # π_r ~ Beta(κπ, κ(1−π)): how much requests of one dataset differ
# Commits per step (mean, std at block 32) of diffusion models outside Optimus Table 2, as their serving papers run
# them. LLaDA-8B in dLLM-Serve (Table 3: 256 steps for 256 tokens, blocks of 32, Fast-dLLM without parallel
# decoding "so that all systems execute the same number of denoising steps"; its decoder unmasks
# ceil(masked / steps left in the block) = 1 position a step): exactly one token a step.
FIXED_SCHEDULE_COMMITS: dict[str, tuple[float, float]] = {"llada-8b": (1.0, 0.0)}


def _clipped_moments(p: float, cap: int) -> tuple[float, float]:
    """E[min(L, cap)] and E[min(L, cap)^2] for L = 1 + Geometric(p) on {0, 1, ...} (P(L > k) = (1-p)^k)."""
    q = 1.0 - p
    m1 = m2 = 0.0
    for k in range(1, cap + 1):                  # E[X] = Σ P(X >= k), E[X²] = Σ (2k − 1) P(X >= k)
        surv = q ** (k - 1)
        m1 += surv
        m2 += (2 * k - 1) * surv
    return m1, m2


@dataclass(frozen=True, slots=True)
class StretchModel:
    """Per step: a stretch L (1 w.p. 1 − π, else 1 + Geometric(p)); a window of c commits min(L, c)."""

    pi: float                   # chance a step finds a predictable stretch
    p: float                    # geometric parameter of its length beyond the first token

    @property
    def stretch_mean(self) -> float:
        """Mean length of a predictable stretch (uncapped)."""
        return 1.0 + (1.0 - self.p) / self.p

    def mean(self, c: int) -> float:
        """E[tokens committed] by a window of c positions."""
        m1, _ = _clipped_moments(self.p, c)
        return (1.0 - self.pi) + self.pi * m1

    def std(self, c: int) -> float:
        m1, m2 = _clipped_moments(self.p, c)
        mean = (1.0 - self.pi) + self.pi * m1
        return math.sqrt(max(0.0, (1.0 - self.pi) + self.pi * m2 - mean * mean))

    @classmethod
    def fit(cls, mean: float, std: float, block: int = TABLE2_BLOCK) -> StretchModel:
        """The (π, p) whose min(L, block) has this mean and standard deviation (ValueError if none does)."""
        if not (1.0 <= mean < block) or std <= 0:
            raise ValueError(f"a commit distribution at block {block} needs 1 <= mean < {block} and std > 0, "
                             f"got mean {mean}, std {std}")
        target = (std * std + mean * mean - 1.0) / (mean - 1.0) if mean > 1.0 else math.inf

        def ratio(p: float) -> float:            # (E[X²] − 1) / (E[X] − 1) of the stretch: 1 + ... up to block + 1
            m1, m2 = _clipped_moments(p, block)
            return (m2 - 1.0) / (m1 - 1.0) - target

        lo, hi = 1e-6, 1.0 - 1e-9
        if not ratio(lo) > 0 > ratio(hi):
            raise ValueError(f"no stretch distribution at block {block} has mean {mean} and std {std}")
        from scipy.optimize import brentq      # here: importing scipy.optimize costs ~0.4 s at CLI start-up

        p = brentq(ratio, lo, hi, xtol=1e-12)
        m1, _ = _clipped_moments(p, block)
        pi = (mean - 1.0) / (m1 - 1.0)
        if not 0.0 < pi <= 1.0:
            raise ValueError(f"no stretch distribution at block {block} has mean {mean} and std {std}")
        return cls(pi, p)


def stretch_model(mean: float, std: float, block: int = TABLE2_BLOCK) -> StretchModel:
    """The StretchModel with this mean and standard deviation at `block`; (1, 0) is one token every step (π = 0)."""
    if mean == 1.0 and std == 0.0:
        return StretchModel(0.0, 1.0)
    return StretchModel.fit(mean, std, block)


def commit_model(model: str, dataset: str) -> StretchModel:
    """The stretch distribution of Optimus Table 2's (model, dataset) cell."""
    table = OPTIMUS_TABLE2.get(model.lower())
    if table is None:
        raise unknown_name("diffusion model", model, OPTIMUS_TABLE2)
    cell = table.get(dataset.lower())
    if cell is None:
        raise unknown_name("dataset", dataset, table)
    return StretchModel.fit(*cell)


__all__ = ["FIXED_SCHEDULE_COMMITS", "OPTIMUS_LENGTHS", "OPTIMUS_TABLE2", "REQUEST_CONCENTRATION", "StretchModel",
           "TABLE2_BLOCK", "commit_model", "stretch_model"]
