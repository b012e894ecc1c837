"""Each request's decoding mode under Optimus's windows (policy/optimus/chunk.py `request_chunk`, the sizer's pinned
windows, the worker core's per-session chunk): `auto` gives a request that wants reproducible tokens (greedy or
seeded) the whole block and the others elastic windows, in the same steps. Expected numbers are worked out in the
docstrings."""
from __future__ import annotations

import pytest

from tandem.core.config import SchedulerConfig
from tandem.core.factory import build_worker
from tandem.core.types import COLOCATED, PrefillTask, StepResult
from tandem.policy.optimus import (ChunkMode, ChunkSizer, ChunkSpec, SeqWindow, StepWindows, parse_chunk,
                                  request_chunk)

AUTO, ELASTIC, BLOCK = ChunkSpec(ChunkMode.AUTO), ChunkSpec(ChunkMode.ELASTIC), ChunkSpec(ChunkMode.BLOCK)
FIXED8 = ChunkSpec(ChunkMode.FIXED, 8)


def three_regimes(x: float) -> float:
    """10 ms flat to 256 query rows, then +20 µs a row to 1024, then +50 µs a row."""
    if x <= 256:
        return 0.010
    if x <= 1024:
        return 0.010 + 20e-6 * (x - 256)
    return 0.010 + 20e-6 * 768 + 50e-6 * (x - 1024)


@pytest.mark.parametrize("default,asked,reproducible,want", [
    (AUTO, None, True, BLOCK),            # greedy or seeded: the whole block, reproducible
    (AUTO, None, False, ELASTIC),         # sampled without a seed: Optimus's windows
    (AUTO, FIXED8, True, FIXED8),         # a request's own chunk wins
    (AUTO, ELASTIC, True, ELASTIC),       # ... even elastic for a greedy request that asks for it
    (AUTO, AUTO, True, BLOCK),            # asking auto is asking nothing
    (ELASTIC, None, True, ELASTIC),       # the old default: elastic for everyone
    (ELASTIC, BLOCK, False, BLOCK),
    (BLOCK, ELASTIC, False, BLOCK),       # a server-wide block or fixed chunk decodes every request
    (FIXED8, BLOCK, True, FIXED8),
])
def test_request_chunk_resolves_each_requests_mode(default, asked, reproducible, want):
    """Protects the per-request decision: which chunk a request decodes with, from the worker's default, what the
    request names and whether it wants reproducible tokens."""
    assert request_chunk(default, asked, reproducible) == want


def test_parse_chunk_takes_auto_and_bounds_a_fixed_chunk():
    """Protects the dllm_chunk values: auto besides elastic, block and N; N at most 4096; digits only in ASCII."""
    assert parse_chunk("auto") == AUTO and str(AUTO) == "auto" and parse_chunk("4096").size == 4096
    for bad in ("4097", 4097, "٣", "x" * 100, None):
        with pytest.raises(ValueError, match="'auto', 'elastic', 'block' or an integer in \\[1, 4096\\]"):
            parse_chunk(bad)


def test_pinned_windows_keep_their_size_and_are_priced_with_the_elastic_ones():
    """Protects the sizer beside pinned windows: with N_commit(m) = min(16, m) learnt, 256 fresh elastic sequences
    alone take c = 4 (1,024 rows in 25.36 ms: 40.4 tokens a ms; c = 8: 2,048 in 76.56 ms, 26.7). Beside 32 pinned
    whole blocks (1,024 rows that run whatever c) the windows are priced with those rows: c = 4 is 2,048 rows in
    76.56 ms (13.4 a ms), c = 8 3,072 in 127.76 ms (16.0), c = 16 5,120 in 230.16 ms (17.8), c = 32 9,216 in
    434.96 ms (9.4): c = 16. The pinned windows stay 32; a pin of 8 over 5 masked positions covers 5."""
    s = ChunkSizer(ChunkSpec(ChunkMode.AUTO), 32, lambda rows, seqs, ctx, sampled, prefill: three_regimes(rows + prefill))
    s.observe(32, [16] * 32)
    assert s.plan([SeqWindow(32)] * 256).chunk == 4
    plan = s.plan([SeqWindow(32, pin=32)] * 32 + [SeqWindow(32)] * 256)
    assert plan.chunk == 16 and plan.windows == [32] * 32 + [16] * 256
    assert s.plan([SeqWindow(5, pin=8), SeqWindow(32)]).windows == [5, 16]


def test_the_budget_caps_a_step_of_pinned_and_elastic_windows():
    """Protects the hard budget with pins (T flat below 256 rows: the most commits per step wins): a pinned block
    (32 rows) and three fresh elastic sequences after it. Room 64: the pin leaves 32, windows of 8 (24 rows) fit
    and 16 (48) do not: [32, 8, 8, 8]. Room 40: 8 left, windows of 2: [32, 2, 2, 2]. Room 20: the pinned block alone
    runs (the first sequence always does) and the others sit out; with an elastic sequence first instead, it runs
    (a window of 16: 16 committed in 10 ms) and the pinned block sits the step out."""
    s = ChunkSizer(ChunkSpec(ChunkMode.AUTO), 32, lambda rows, seqs, ctx, sampled, prefill: three_regimes(rows + prefill))
    s.observe(32, [16] * 32)
    seqs = [SeqWindow(32, pin=32)] + [SeqWindow(32)] * 3
    assert s.plan(seqs, room=64) == StepWindows(8, [32, 8, 8, 8])
    assert s.plan(seqs, room=40) == StepWindows(2, [32, 2, 2, 2])
    assert s.plan(seqs, room=20).windows == [32]
    assert s.plan([SeqWindow(32), SeqWindow(32, pin=32), SeqWindow(32)], room=20) == StepWindows(16, [16])


def _worker(chunk: str, block: int = 8):
    return build_worker(0, COLOCATED, 1, 64, "vllm", SchedulerConfig(dllm_block_length=block, dllm_chunk=chunk),
                        t_pre=lambda h, n: 0.01)


def test_the_core_runs_a_whole_block_beside_a_streaming_window_in_one_step():
    """Protects per-session modes in the worker core under auto: a greedy session `g` (block) and a sampled one `s`
    (elastic) with 8-token prompts decode 16 tokens in blocks of 8. First step: both cover the 8 masked positions.
    Each commits 3: `g` recomputes its whole block (8 rows, nothing to write first, may commit the 5 left) while `s`
    covers the 5 masked positions and writes the 3 commits' K/V (8 rows). Each commits the 5: `g` writes its finished
    block with the next block's 8 positions (16 rows), `s` its 5 commits with the next window of 8 (13 rows). A
    session never told decodes elastic windows."""
    w = _worker("auto")
    assert w.choose_chunk("g", None, reproducible=True) == ChunkSpec(ChunkMode.BLOCK)
    assert w.choose_chunk("s", None, reproducible=False) == ChunkSpec(ChunkMode.ELASTIC)
    assert w.chunk_of("never-told") == ChunkSpec(ChunkMode.ELASTIC)
    for sid in ("g", "s"):
        w.begin_round(sid)
        w.submit(PrefillTask(sid, 0, 0, 8, 0.0, output_tokens=16, decode_worker=0, worker=0), 0.0)
    plan = w.schedule(0.0)
    while not plan.decode:
        w.on_step_done(plan, StepResult(1.0), 1.0)
        plan = w.schedule(1.0)
    seen = []
    for commit in (3, 5, 0):
        seen.append([(s.session_id, s.query_tokens, s.commit_cap, s.kv_pending) for s in plan.decode])
        w.on_step_done(plan, StepResult(1.0, {s.session_id: commit for s in plan.decode}), 2.0)
        plan = w.schedule(2.0)
    assert seen == [[("g", 8, 8, 0), ("s", 8, 8, 0)],
                    [("g", 8, 5, 0), ("s", 8, 5, 3)],
                    [("g", 16, 8, 8), ("s", 13, 8, 5)]]


def test_a_block_worker_decodes_every_session_whole_blocks():
    """Protects the server-wide modes in the core: under dllm_chunk=block a session that asks for elastic windows
    still decodes whole blocks (the operator's load-independent mode wins), and the core says so."""
    w = _worker("block")
    assert w.choose_chunk("x", ChunkSpec(ChunkMode.ELASTIC), reproducible=False) == ChunkSpec(ChunkMode.BLOCK)
    assert w.chunk_of("x") == ChunkSpec(ChunkMode.BLOCK)
