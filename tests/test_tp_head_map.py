"""The KV head maps of tensor-parallel workers and how a session's KV regroups between degrees (a prefill worker at
tp=a, a decode worker at tp=b): each rank's heads, the wire's source of each head, and the rank-to-rank moves, with
exact expectations for 2 KV heads (the tiny Qwen3's; replicated at tp=4) and 8."""
from __future__ import annotations

import pytest

from tandem.engine.parallel.group import TPGroup
from tandem.engine.parallel.head_map import HeadMapError, KVMove, holders, kv_head_spans, regroup_plan, wire_sources


def test_spans_match_the_layers_split_and_replicate_beyond_the_kv_heads():
    """Protects the agreement with the attention layers' split (TPGroup.kv_heads) and the replication rule."""
    assert kv_head_spans(2, 1) == [(0, 2)]
    assert kv_head_spans(2, 2) == [(0, 1), (1, 1)]
    assert kv_head_spans(2, 4) == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert kv_head_spans(8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    for total in (1, 2, 4, 8):
        for tp in (1, 2, 4, 8, 16):
            if total % tp and tp % total:
                continue
            assert kv_head_spans(total, tp) == [TPGroup(r, tp).kv_heads(total) for r in range(tp)]
    assert holders(2, 4) == [[0, 1], [2, 3]]
    assert wire_sources(2, 4) == [0, 2]
    assert wire_sources(8, 2) == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("src,dst,moves", [
    (1, 1, [KVMove(0, 0, 0, 2)]),
    (2, 2, [KVMove(0, 0, 0, 1), KVMove(1, 1, 1, 1)]),
    (1, 2, [KVMove(0, 0, 0, 1), KVMove(0, 1, 1, 1)]),
    (2, 1, [KVMove(0, 0, 0, 1), KVMove(1, 0, 1, 1)]),
    (2, 4, [KVMove(0, 0, 0, 1), KVMove(0, 1, 0, 1), KVMove(1, 2, 1, 1), KVMove(1, 3, 1, 1)]),
    (4, 2, [KVMove(0, 0, 0, 1), KVMove(2, 1, 1, 1)]),
    (4, 4, [KVMove(0, 0, 0, 1), KVMove(1, 1, 0, 1), KVMove(2, 2, 1, 1), KVMove(3, 3, 1, 1)]),
    (1, 4, [KVMove(0, 0, 0, 1), KVMove(0, 1, 0, 1), KVMove(0, 2, 1, 1), KVMove(0, 3, 1, 1)]),
])
def test_regroup_two_kv_heads(src, dst, moves):
    """Protects the rank-to-rank regrouping over 2 KV heads, replicated at tp=4: every receiving rank gets exactly
    its heads, each from one holder (a replicated head read from the holder at the receiver's position)."""
    assert regroup_plan(2, src, dst) == moves


def test_regroup_eight_kv_heads_merges_contiguous_heads():
    """Protects the merging of a sender's contiguous heads into one move, tp 2 -> 4 and 4 -> 2 over 8 KV heads."""
    assert regroup_plan(8, 2, 4) == [KVMove(0, 0, 0, 2), KVMove(0, 1, 2, 2), KVMove(1, 2, 4, 2), KVMove(1, 3, 6, 2)]
    assert regroup_plan(8, 4, 2) == [KVMove(0, 0, 0, 2), KVMove(1, 0, 2, 2), KVMove(2, 1, 4, 2), KVMove(3, 1, 6, 2)]


def test_every_receiver_gets_exactly_its_heads():
    """Protects completeness: for every pair of degrees up to 8 over 1..8 KV heads, the moves to each receiving rank
    cover its span once, and every sender holds what it sends."""
    for total in (1, 2, 4, 8):
        tps = [t for t in (1, 2, 4, 8) if not (total % t and t % total)]
        for a in tps:
            src = kv_head_spans(total, a)
            for b in tps:
                got: dict[int, list[int]] = {}
                for mv in regroup_plan(total, a, b):
                    f, c = src[mv.src]
                    assert f <= mv.first and mv.first + mv.count <= f + c
                    got.setdefault(mv.dst, []).extend(range(mv.first, mv.first + mv.count))
                assert got == {d: list(range(f, f + c)) for d, (f, c) in enumerate(kv_head_spans(total, b))}


def test_a_degree_that_cannot_split_the_heads_is_one_line():
    """Protects the error: tp 3 over 2 KV heads, and non-integers."""
    with pytest.raises(HeadMapError, match=r"^tensor-parallel degree 3 neither divides the 2 KV heads nor is a "
                                           r"multiple of them$"):
        kv_head_spans(2, 3)
    with pytest.raises(HeadMapError, match="integers >= 1"):
        regroup_plan(2, 0, 1)
