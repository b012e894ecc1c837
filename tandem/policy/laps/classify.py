"""LAPS §3.2 mutual exclusion: every prefill is short (memory-bound) or long (compute-bound) by its new tokens."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from tandem.policy.checks import check_int
from tandem.policy.laps.cost import PrefillCostModel

__all__ = ["DEFAULT_THRESHOLD", "LengthClassifier", "PrefillClass"]

# LAPS's own implementation splits at 256 new tokens when no fitted boundary is given.
DEFAULT_THRESHOLD = 256
# A boundary within this relative distance above an integer is taken as that integer, so that a
# boundary of 300 computed as 300.00000000000006 still gives threshold 300.
_ROUND_TOL = 1e-9


class PrefillClass(StrEnum):
    """Which LAPS queue and instance pool a prefill belongs to; equal to its wire form."""

    SHORT = "short"
    LONG = "long"


@dataclass(frozen=True, slots=True)
class LengthClassifier:
    """Classifies a (re-)prefill as SHORT when its new tokens are below `threshold`, else LONG."""

    threshold: int = DEFAULT_THRESHOLD

    def __post_init__(self) -> None:
        check_int("threshold", self.threshold, 1, "an int")

    def classify(self, new_tokens: int, history_tokens: int = 0) -> PrefillClass:
        """SHORT when new_tokens < threshold, else LONG.

        history_tokens is validated but does not move the threshold, which is fixed at construction:
        to split re-prefills at L_m^re-prefill(H), build the classifier with from_cost_model(model, H).
        """
        check_int("new_tokens", new_tokens, 0, "an int")
        check_int("history_tokens", history_tokens, 0, "an int")
        return PrefillClass.SHORT if new_tokens < self.threshold else PrefillClass.LONG

    @classmethod
    def from_cost_model(cls, model: PrefillCostModel, history_tokens: int = 0) -> LengthClassifier:
        """Threshold at the fitted boundary: L_m^prefill (H = 0) or L_m^re-prefill(H), rounded up, at least 1.

        An integer L is then SHORT exactly when L < L_m, i.e. when the (re-)prefill is memory-bound.
        """
        check_int("history_tokens", history_tokens, 0, "an int")
        bound = model.prefill_boundary() if history_tokens == 0 else model.reprefill_boundary(history_tokens)
        nearest = round(bound)
        if abs(bound - nearest) <= _ROUND_TOL * max(1.0, bound):
            bound = float(nearest)
        return cls(max(1, math.ceil(bound)))
