"""What a planner run simulates besides the deployment: the simulator settings and the hashed sessions."""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.workload.session import Session


@dataclass(frozen=True, slots=True)
class SimSpec:
    """Everything a run needs besides the sessions and the deployment."""

    model: str
    gpu: str
    policy: str = "ampd"
    seed: int = 0
    sim: tuple[tuple[str, object], ...] = ()   # extra SimConfig fields


@dataclass(slots=True)
class Workload:
    """The sessions every deployment is simulated on, and a content hash of them."""

    sessions: list[Session]
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            self.key = sessions_hash(self.sessions)

    def stretched(self, factor: float) -> "Workload":
        """The same sessions with every arrival time multiplied by `factor` (rate divided by it)."""
        if factor == 1:
            return self
        return Workload([dataclasses.replace(s, arrival_s=s.arrival_s * factor) for s in self.sessions])


def sessions_hash(sessions: Sequence[Session]) -> str:
    """SHA-256 of what the simulator reads from the sessions."""
    h = hashlib.sha256()
    for s in sessions:
        slo = None if s.slo is None else (s.slo.ttft_s, s.slo.itl_s)
        rounds = [(r.input_tokens, r.output_tokens, r.tool_s, r.hash_ids) for r in s.rounds]
        h.update(repr((s.session_id, s.arrival_s, slo, s.block_size, rounds)).encode())
    return h.hexdigest()
