"""Which rank of a tensor-parallel worker holds which KV heads, and how a session's KV regroups between workers of
different degrees (a prefill worker at tp=a handing KV to a decode worker at tp=b). Pure arithmetic, no torch.

Rank r of a group of `tp` ranks over `total` KV heads holds a contiguous share of total // tp heads when tp divides
them, else (tp a multiple of total) the one KV head its query heads read, replicated on tp // total ranks: the same
split as `TPGroup.kv_heads`. On the wire a session's KV carries every KV head once, in head order (`wire_sources`
says which sending rank supplies each); each receiving rank takes exactly its own heads (`kv_head_spans`).
`regroup_plan` is the same regrouping written rank to rank: which heads each receiving rank needs from which sending
rank."""
from __future__ import annotations

from dataclasses import dataclass


class HeadMapError(ValueError):
    """A degree that cannot split the KV heads (one line)."""


@dataclass(frozen=True, slots=True)
class KVMove:
    """KV heads [first, first + count) of a session, from rank `src` of the sending group to rank `dst` of the
    receiving one."""

    src: int
    dst: int
    first: int
    count: int


def _check(total: int, tp: int) -> None:
    if not isinstance(total, int) or not isinstance(tp, int) or total < 1 or tp < 1:
        raise HeadMapError(f"KV heads and tensor-parallel degree must be integers >= 1, got {total!r} and {tp!r}")
    if total % tp and tp % total:
        raise HeadMapError(f"tensor-parallel degree {tp} neither divides the {total} KV heads nor is a multiple of "
                           f"them")


def kv_head_spans(total: int, tp: int) -> list[tuple[int, int]]:
    """(first, count) of the KV heads each rank 0..tp-1 holds (a replicated head appears on several ranks)."""
    _check(total, tp)
    if tp <= total:
        n = total // tp
        return [(r * n, n) for r in range(tp)]
    return [(r * total // tp, 1) for r in range(tp)]


def holders(total: int, tp: int) -> list[list[int]]:
    """For each KV head, the ranks that hold it (one rank, or tp // total ranks when heads are replicated)."""
    out: list[list[int]] = [[] for _ in range(total)]
    for r, (first, count) in enumerate(kv_head_spans(total, tp)):
        for h in range(first, first + count):
            out[h].append(r)
    return out


def wire_sources(total: int, tp: int) -> list[int]:
    """For each KV head, the sending rank that supplies it to the wire payload: its first holder (a replicated head
    travels once)."""
    return [hs[0] for hs in holders(total, tp)]


def regroup_plan(total: int, src_tp: int, dst_tp: int) -> list[KVMove]:
    """The moves that give every rank of a dst_tp group exactly its KV heads from a src_tp group's ranks: each head a
    receiving rank needs comes from the holder nearest the receiver's proportional position (dst * src_tp //
    dst_tp, the lower rank on a tie), contiguous heads from one sender merged into one move; ordered by receiver."""
    src_holders = holders(total, src_tp)
    moves: list[KVMove] = []
    for dst, (first, count) in enumerate(kv_head_spans(total, dst_tp)):
        aim = dst * src_tp // dst_tp
        for h in range(first, first + count):
            src = min(src_holders[h], key=lambda r: (abs(r - aim), r))
            last = moves[-1] if moves else None
            if last is not None and last.dst == dst and last.src == src and last.first + last.count == h:
                moves[-1] = KVMove(src, dst, last.first, last.count + 1)
            else:
                moves.append(KVMove(src, dst, h, 1))
    return moves
