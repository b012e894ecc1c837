"""Which decode (or co-located) worker a new session is bound to for its whole life."""
from __future__ import annotations

from typing import Sequence


class LeastKVBinder:
    """Bind to the worker with the smallest fraction of its KV pool committed (AMPD step 1, Dynamo's KV router)."""

    def bind(self, workers: Sequence[int], committed_tokens: dict[int, int], capacity: dict[int, int]) -> int:
        return min(workers, key=lambda w: (committed_tokens.get(w, 0) / capacity[w], w))
