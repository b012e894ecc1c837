"""LAPS §3.2 mutual exclusion: every prefill is short (memory-bound) or long (compute-bound) by its new tokens."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tandem.policy.checks import check_int

__all__ = ["DEFAULT_THRESHOLD", "LengthClassifier", "PrefillClass"]

# LAPS's own implementation splits at 256 new tokens when no fitted boundary is given.
DEFAULT_THRESHOLD = 256


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

        history_tokens is validated but does not move the threshold, which is fixed at construction (the shells
        set it to L_m^prefill: tandem.policy.laps.cost.boundary_from_profile).
        """
        check_int("new_tokens", new_tokens, 0, "an int")
        check_int("history_tokens", history_tokens, 0, "an int")
        return PrefillClass.SHORT if new_tokens < self.threshold else PrefillClass.LONG
