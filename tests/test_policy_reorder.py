"""AMPD Alg. 2 (TTFT-aware reordering) and the other queue pickers."""
from tandem.core.types import PrefillTask
from tandem.policy.reorder import FCFS, SessionFirst, TTFTAwareReorder


def t(name, enq, est, slo=1.0, hist=0):
    task = PrefillTask(name, 0, hist, 100, enq, ttft_slo_s=slo)
    task.est_s = est
    return task


def names(q):
    return [x.session_id for x in q]


def test_reorder_moves_a_short_task_ahead_when_that_saves_its_ttft():
    # a: 0.8 s long, b: 0.1 s but has waited 0.8 s. FCFS: a ok (0.8), b late (0.8+0.9). Swap: both ok.
    q = [t("a", 0.0, 0.8), t("b", 0.0, 0.1)]
    q[1].enqueue_s = -0.8
    r = TTFTAwareReorder(window=3)
    assert r.pick(q, 0.0) == 0
    assert names(q) == ["b", "a"]
    assert q[1].postponed == 1 and q[0].postponed == 0


def test_reorder_keeps_fcfs_on_ties():
    q = [t("a", 0.0, 0.1), t("b", 0.0, 0.1), t("c", 0.0, 0.1)]
    TTFTAwareReorder(3).pick(q, 0.0)
    assert names(q) == ["a", "b", "c"]
    assert [x.postponed for x in q] == [0, 0, 0]


def test_reorder_only_looks_at_the_window():
    q = [t("a", 0.0, 2.0), t("b", 0.0, 2.0), t("c", 0.0, 0.1)]
    TTFTAwareReorder(window=2).pick(q, 0.0)
    assert names(q) == ["a", "b", "c"]


def test_no_task_is_postponed_more_than_w_times():
    w = 3
    r = TTFTAwareReorder(window=w)
    victim = t("victim", 0.0, 0.9)
    q = [victim]
    postponed_heads = 0
    for i in range(10):
        # each round a fresh short urgent task arrives behind the victim
        urgent = t(f"u{i}", -0.85, 0.1)
        q.insert(1, urgent)
        r.pick(q, 0.0)
        assert victim.postponed <= w
        if q[0] is victim:
            break
        postponed_heads += 1
        q.pop(0)                      # dequeue the head, as the worker does
    assert victim.postponed == w
    assert postponed_heads == w
    assert q[0] is victim


def test_fcfs_picks_head():
    q = [t("a", 0.0, 1.0), t("b", 0.0, 0.1)]
    assert FCFS().pick(q, 0.0) == 0


def test_session_first_prefers_continuations_with_resident_kv():
    q = [t("new", 0.0, 1.0), t("cont", 0.0, 1.0, hist=500)]
    assert SessionFirst().pick(q, 0.0) == 1
    assert SessionFirst().pick([t("a", 0, 1.0)], 0.0) == 0
