"""In-process state store: the coordinator's view of worker queues, windowed stats and KV residency."""
from __future__ import annotations

from typing import Sequence

from tandem.core.types import PREFILL, SeqState
from tandem.core.worker import WorkerCore


class InProcessState:
    """Reads worker cores directly (one process); a Redis-backed store offers the same methods."""

    def __init__(self, workers: list[WorkerCore], cost, nodes: list[int]) -> None:
        self.workers = workers
        self.cost = cost            # perf.ampd_cost.AMPDCostModel: t_pre / t_kv estimates
        self.nodes = nodes
        self._prefill = [w.id for w in workers if w.role == PREFILL]
        self._homes = [w.id for w in workers if w.role != PREFILL]

    def drop(self, worker: int) -> None:
        """Stop listing a lost worker (the live state store does this by heartbeat expiry)."""
        self._prefill = [w for w in self._prefill if w != worker]
        self._homes = [w for w in self._homes if w != worker]

    def prefill_workers(self) -> Sequence[int]:
        return self._prefill

    def home_workers(self) -> Sequence[int]:
        return self._homes

    def windowed_ttft(self, worker: int, now: float) -> float:
        return self.workers[worker].ttft.mean(now)

    def windowed_itl(self, worker: int, now: float) -> float:
        return self.workers[worker].itl.mean(now)

    def queued_prefill_s(self, worker: int) -> float:
        return self.workers[worker].pending_prefill_s()

    def queued_prefill_by_class(self, worker: int) -> tuple[float, float]:
        return self.workers[worker].pending_prefill_by_class()

    def utilization(self, worker: int, now: float) -> float:
        return self.workers[worker].utilization(now)

    def t_pre(self, worker: int, l_hist: int, l_incr: int) -> float:
        return self.cost.t_pre(l_hist, l_incr, self.workers[worker].cfg.tp)

    def t_kv(self, tokens: int, src: int, dst: int) -> float:
        ws = self.workers
        return self.cost.t_kv(tokens, ws[src].cfg.tp, ws[dst].cfg.tp, self.nodes[src] == self.nodes[dst])

    def can_hold(self, worker: int, tokens: int) -> bool:
        return tokens <= self.workers[worker].capacity_tokens

    def capacity(self, worker: int) -> int:
        return self.workers[worker].capacity_tokens

    def begin_round(self, worker: int, session_id: str, block_hashes: Sequence[int] = (), prompt_tokens: int = 0,
                    now: float | None = None) -> int:
        return self.workers[worker].begin_round(session_id, block_hashes, prompt_tokens, now)

    def held(self, worker: int, session_id: str) -> tuple[int, int]:
        """Tokens of the session's context `worker` holds on its GPU and in its host tier."""
        w = self.workers[worker]
        seq = w.seqs.get(session_id)
        if seq is None:
            return 0, 0
        gpu = 0 if seq.state is SeqState.OFFLOADED else seq.num_tokens
        tier = w.kv.tier
        host = seq.host_tokens if tier is not None and tier.host.session(session_id) is not None else 0
        return gpu, host

    def kv_loading(self, worker: int, session_id: str) -> bool:
        """Whether the session's KV on `worker` is being copied back from its host tier (not readable yet)."""
        seq = self.workers[worker].seqs.get(session_id)
        return seq is not None and seq.loading is not None
