"""LAPS §3.1 captured-shape grid: (prompt length, batch size) buckets, each with one captured CUDA graph.

A batch of short prefills runs in the graph of the smallest bucket holding it — every request padded
to the bucket's length, the batch padded to its batch size — or, when no bucket holds it within the
memory budget, in the standard (unpadded) prefill kernel. Memory is counted in tokens: a bucket
occupies tokens × batch padded tokens.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.policy.checks import check_int

__all__ = ["Bucket", "BucketGrid"]


@dataclass(frozen=True, slots=True)
class Bucket:
    """One captured graph shape: `batch` requests of `tokens` (padded) new tokens each."""

    tokens: int
    batch: int

    def __post_init__(self) -> None:
        check_int("tokens", self.tokens, 1, "an int")
        check_int("batch", self.batch, 1, "an int")

    @property
    def padded_tokens(self) -> int:
        """Tokens the graph processes, padding included: tokens × batch."""
        return self.tokens * self.batch


@dataclass(frozen=True, slots=True)
class BucketGrid:
    """The captured (length, batch) grid; LAPS's default is powers of two, 8..256 tokens × 1..64 requests."""

    lengths: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

    def __post_init__(self) -> None:
        for name in ("lengths", "batches"):
            values = tuple(getattr(self, name))
            if not values:
                raise ValueError(f"{name} must not be empty")
            for v in values:
                check_int(f"every entry of {name}", v, 1, "an int")
            if any(a >= b for a, b in zip(values, values[1:])):
                raise ValueError(f"{name} must be strictly increasing, got {values!r}")
            object.__setattr__(self, name, values)

    def length_index(self, tokens: int) -> int:
        """Index of the smallest captured length >= tokens; len(lengths) when none is long enough."""
        check_int("tokens", tokens, 1, "an int")
        return bisect_left(self.lengths, tokens)

    def nearest(self, lengths: Sequence[int], mem_budget_tokens: int | None = None) -> Bucket | None:
        """NearestGraph: the smallest bucket holding the batch whose padded size fits the budget, else None.

        The smallest captured length >= max(lengths) and the smallest captured batch >= len(lengths)
        form the bucket that is smallest in both dimensions, hence in padded size; if it exceeds the
        budget every other holding bucket does too. None means: use the standard prefill kernel.
        """
        check_int("mem_budget_tokens", mem_budget_tokens, 0, "an int", optional=True)
        if not lengths:
            raise ValueError("nearest() needs a non-empty batch")
        for x in lengths:
            check_int("every request length", x, 1, "an int")
        li = self.length_index(max(lengths))
        bi = bisect_left(self.batches, len(lengths))
        if li == len(self.lengths) or bi == len(self.batches):
            return None
        bucket = Bucket(self.lengths[li], self.batches[bi])
        if mem_budget_tokens is not None and bucket.padded_tokens > mem_budget_tokens:
            return None
        return bucket

    def max_depth(self, mem_budget_tokens: int | None, length: int = 1) -> int:
        """Largest captured batch B with a bucket (L >= length, B) within the budget; 0 when none fits.

        Alg. 1's initial depth D = max over captured graphs G with mem(G) <= M of depth(G). The
        shortest captured length >= `length` admits the most requests, so only it is checked.
        """
        check_int("mem_budget_tokens", mem_budget_tokens, 0, "an int", optional=True)
        li = self.length_index(length)
        if li == len(self.lengths):
            return 0
        if mem_budget_tokens is None:
            return self.batches[-1]
        fitting = [b for b in self.batches if self.lengths[li] * b <= mem_budget_tokens]
        return fitting[-1] if fitting else 0
