"""A worker's tensor-parallel group as its layers see it: this rank, the group's size, how heads, KV heads, the MLP
and the vocabulary split across ranks, and the two collectives a sharded layer needs (a sum over ranks, a gather of
logits to the driver). Rank 0 is the driver (it runs the worker core and samples)."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from tandem.engine.models.config import ModelConfig


@dataclass
class CommStats:
    """Time this rank spent in the group's all-reduces (waiting for the other ranks included)."""

    all_reduce_s: float = 0.0
    all_reduces: int = 0


@dataclass(frozen=True)
class TPGroup:
    """One rank's place in its tensor-parallel group (size 1: no group, every collective a no-op)."""

    rank: int = 0
    size: int = 1
    comm: CommStats = field(default_factory=CommStats, compare=False, repr=False)

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the worker core, samples, and receives the gathered logits."""
        return self.rank == 0

    def heads(self, total: int) -> tuple[int, int]:
        """(first, count) of this rank's attention heads out of `total` (check_shardable has checked they divide)."""
        n = total // self.size
        return self.rank * n, n

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(first, count) of this rank's KV heads: a share when the ranks divide them, else the one KV head its query
        heads read (replicated over size // total ranks)."""
        if self.size <= total:
            n = total // self.size
            return self.rank * n, n
        return self.rank * total // self.size, 1

    def split(self, total: int) -> tuple[int, int]:
        """(first, count) of an evenly divided dimension (the MLP's intermediate features)."""
        n = total // self.size
        return self.rank * n, n

    def vocab(self, total: int) -> tuple[int, int, int]:
        """(first, real rows, padded rows) of this rank's slice of the vocabulary: ceil(total / size) rows per rank,
        the last rank's tail padding."""
        per = -(-total // self.size)
        first = min(total, self.rank * per)
        return first, min(total, first + per) - first, per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group's ranks in place (torch.distributed), timed into `comm`."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        t0 = time.perf_counter()
        dist.all_reduce(x)
        self.comm.all_reduce_s += time.perf_counter() - t0
        self.comm.all_reduces += 1
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's logits [N, padded rows] gathered on the driver into [N, vocab_size]; None on other ranks."""
        if self.size == 1:
            return local[:, :vocab_size]
        import torch.distributed as dist
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_driver else None
        dist.gather(local, parts, dst=0)
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, :vocab_size]


SINGLE = TPGroup()
_building: list[TPGroup] = [SINGLE]


@contextmanager
def building(group: TPGroup) -> Iterator[TPGroup]:
    """Models constructed inside take their shards from `group` (the layers read current_group())."""
    _building.append(group)
    try:
        yield group
    finally:
        _building.pop()


def current_group() -> TPGroup:
    """The group a layer under construction belongs to (SINGLE outside `building`)."""
    return _building[-1]


def check_shardable(mc: "ModelConfig", size: int) -> None:
    """ValueError (one line) unless `size` ranks can split the model: its attention heads, its KV heads (divided,
    or replicated when the ranks are a multiple of them) and its MLP's intermediate features."""
    if size == 1:
        return
    if mc.num_attention_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {mc.num_attention_heads} "
                         f"attention heads")
    kv = mc.num_key_value_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size} neither divides the model's {kv} KV heads nor is a multiple "
                         f"of them")
    if mc.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's intermediate size "
                         f"{mc.intermediate_size}")


def default_rank_threads(size: int) -> int:
    """torch threads of each rank of a CPU group of `size` ranks: an even share of the usable cores (at least one)."""
    return max(1, usable_cpus() // size)


def usable_cpus() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - no affinity API (macOS)
        return os.cpu_count() or 1
