"""The core's KV block manager prefix cache and the worker core's use of it (shared by engine and simulator)."""
from __future__ import annotations

from tandem.core.block_manager import BlockManager, OutOfBlocks
from tandem.core.prefix_hash import extend_hashes
from tandem.core.types import COLOCATED, PrefillTask, StepResult
from tandem.core.worker import WorkerConfig, WorkerCore


def test_chained_hashes_name_whole_prefixes():
    a = extend_hashes([], list(range(40)), 16)
    b = extend_hashes([], list(range(32)) + [7] * 8, 16)
    c = extend_hashes([], [99] + list(range(1, 40)), 16)
    assert len(a) == 2 and a == b                      # only full blocks are hashed
    assert c[0] != a[0] and c[1] != a[1]               # a different first block changes every later hash
    assert extend_hashes(a[:1], list(range(40)), 16) == a   # extending continues the chain


def test_freed_blocks_stay_matchable_until_reused_lru():
    bm = BlockManager(4, block_size=4)
    bm.grow("a", 8)
    bm.register("a", 0, 111)
    bm.register("a", 1, 222)
    assert bm.match_prefix([111, 222, 333]) == bm.tables["a"][:2]
    blocks = list(bm.tables["a"])
    bm.free("a")
    assert bm.num_free == 4
    assert bm.match_prefix([111, 222]) == blocks       # still cached after free
    bm.share("b", blocks)
    assert bm.num_free == 2 and bm.tables["b"] == blocks
    bm.share("c", blocks[:1])                          # two owners of one block
    bm.free("b")
    assert bm.num_free == 3                            # block 0 still referenced by c
    bm.free("c")
    bm.grow("d", 16)                                   # takes every block: the cached content is forgotten
    assert bm.match_prefix([111]) == []
    try:
        bm.grow("e", 1)
    except OutOfBlocks:
        pass
    else:
        raise AssertionError("expected OutOfBlocks")
    assert "e" not in bm.tables


def _drive(core: WorkerCore, now: float = 0.0) -> int:
    """Run steps until idle; returns the prefill tokens computed."""
    computed = 0
    while (plan := core.schedule(now)) is not None:
        computed += sum(n for _, n in plan.prefill)
        now += 1.0
        core.on_step_done(plan, StepResult(1.0), now)
        core.drain()
    return computed


def test_worker_core_reuses_cached_prefix_and_always_computes_a_token():
    core = WorkerCore(0, WorkerConfig(role=COLOCATED, tp=1, num_blocks=64, block_size=16,
                                      mix_decode_with_prefill=True))
    tokens = list(range(70))
    hashes = tuple(extend_hashes([], tokens, 16))
    tasks, computed = [], []
    for sid in ("x", "y"):                             # y arrives once x's prefill has been computed
        core.begin_round(sid)
        tasks.append(PrefillTask(sid, 0, 0, 70, 0.0, output_tokens=2, block_hashes=hashes))
        core.submit(tasks[-1], 0.0)
        computed.append(_drive(core))
    assert computed == [70, 70 - 64]                   # y reuses x's four full blocks
    assert [t.cached for t in tasks] == [0, 64]
    core.release("x")
    core.release("y")
    core.begin_round("z")                              # a prompt of exactly 64 tokens: one must still run
    z = PrefillTask("z", 0, 0, 64, 0.0, output_tokens=2, block_hashes=hashes[:4])
    core.submit(z, 0.0)
    assert _drive(core) == 16 and z.cached == 48


def test_early_stop_ends_the_round_on_the_first_token():
    core = WorkerCore(0, WorkerConfig(role=COLOCATED, tp=1, num_blocks=8, block_size=16,
                                      mix_decode_with_prefill=True))
    core.begin_round("s")
    core.submit(PrefillTask("s", 0, 0, 5, 0.0, output_tokens=50), 0.0)
    plan = core.schedule(0.0)
    core.on_step_done(plan, StepResult(1.0, None, {"s"}), 1.0)
    kinds = [type(e).__name__ for e in core.drain()]
    assert kinds == ["FirstToken", "RoundDone"] and not core.running
