"""Sessions: multi-round conversations, the unit every tandem workload is made of."""
from __future__ import annotations

from dataclasses import dataclass, field


class WorkloadError(ValueError):
    """A workload (trace file, generator argument) is malformed or invalid; the message says where."""


@dataclass(slots=True)
class SLO:
    """Per-session latency objectives: every round's TTFT and the session's mean ITL."""

    ttft_s: float
    itl_s: float


@dataclass(slots=True)
class Round:
    """One round: `input_tokens` new tokens are prefilled, then `output_tokens` are decoded."""

    input_tokens: int
    output_tokens: int
    tool_s: float = 0.0
    hash_ids: list[int] | None = None


@dataclass(slots=True)
class Session:
    """A multi-round conversation arriving at `arrival_s`; round k>0 appends to everything before it."""

    session_id: str
    arrival_s: float
    rounds: list[Round]
    slo: SLO | None = None
    block_size: int | None = None
    model: str | None = None
    messages: list | None = None
    extra: dict = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        """Context length after the last round: all inputs plus all outputs."""
        return sum(r.input_tokens + r.output_tokens for r in self.rounds)
