"""What `tandem plan` costs besides simulating: it never imports torch (nor pandas, fastapi, matplotlib or
scipy.stats), its parser imports no scipy at all, and the shortcuts behind that keep every result identical:
the block pool's hand-out order, the parquet columns, the warm-up before processes fork."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest

from tandem.core.block_manager import BlockManager
from tandem.perf.measured import source

HEAVY = ("torch", "pandas", "fastapi", "matplotlib", "scipy.stats")


def _modules_after(code: str) -> dict:
    """Run `code` in a fresh interpreter; which of HEAVY (and scipy, scipy.optimize) it imported."""
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps({{m: m in sys.modules for m in {HEAVY!r} + ('scipy', 'scipy.optimize')}}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_building_the_cli_parser_imports_neither_torch_nor_scipy():
    """Protects every command's start-up: torch costs about 0.8 s, scipy.optimize about 0.4 s to import."""
    seen = _modules_after("from tandem.cli.main import build_parser\nbuild_parser()")
    assert seen == {m: False for m in HEAVY + ("scipy", "scipy.optimize")}


def test_a_whole_plan_command_never_imports_torch(tmp_path):
    """Protects `tandem plan`'s wall time: the planner needs the simulator, never the engine."""
    code = ("import contextlib, io\nfrom tandem.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = main(['plan', '--gpus', '8', '--workload', 'toolbench', '--rate', '1.2', '--sessions', '6',"
            f" '--jobs', '1', '--cache-dir', {str(tmp_path)!r}, '--best-effort', '--no-progress'])\n"
            "assert rc == 0, rc")
    seen = _modules_after(code)
    assert {m: seen[m] for m in HEAVY} == {m: False for m in HEAVY}


def test_a_plan_from_the_run_cache_builds_no_simulator(tmp_path):
    """Protects `tandem plan`'s warm wall time (the same command again): every run comes from the cache, so neither
    the simulator (tandem.sim.cluster) nor the factory of its cores (tandem.core.factory) is imported."""
    argv = ["plan", "--gpus", "8", "--workload", "toolbench", "--rate", "1.2", "--sessions", "6", "--jobs", "1",
            "--cache-dir", str(tmp_path), "--best-effort", "--no-progress"]
    code = ("import contextlib, io, json, sys\nfrom tandem.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = main({argv!r})\n"
            "assert rc == 0, rc\n"
            "print(json.dumps([m for m in ('tandem.sim.cluster', 'tandem.core.factory') if m in sys.modules]))")
    cold = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    warm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(cold.stdout.strip().splitlines()[-1]) == ["tandem.sim.cluster", "tandem.core.factory"]
    assert json.loads(warm.stdout.strip().splitlines()[-1]) == []


class _ReferencePool:
    """The block pool as one ordered dict of every block (what BlockManager did before handing out never-used
    blocks from a counter): the order blocks are handed out in must not change."""

    def __init__(self, n: int):
        self.free = OrderedDict.fromkeys(range(n))

    def take(self) -> int:
        return self.free.popitem(last=False)[0]


def test_the_block_pool_hands_out_blocks_in_the_order_one_ordered_dict_would():
    """Protects simulated and served results: block ids decide which cached prefixes survive."""
    rng = random.Random(7)
    bm, ref = BlockManager(64, block_size=4), _ReferencePool(64)
    owners: dict[int, list[int]] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.5:
            o = rng.randrange(12)
            tokens = 4 * (len(bm.tables.get(o, ())) + rng.randrange(1, 6))
            need = bm.extra_blocks(o, tokens)
            if need > len(ref.free):
                continue
            bm.grow(o, tokens)
            owners.setdefault(o, []).extend(ref.take() for _ in range(need))
        elif op < 0.8 and owners:
            o = rng.choice(sorted(owners))
            bm.free(o)
            for b in reversed(owners.pop(o)):
                ref.free[b] = None
        assert bm.num_free == len(ref.free), step
        assert {o: bm.tables[o] for o in owners} == owners, step
    assert bm.usage == 1.0 - len(ref.free) / 64


@pytest.mark.skipif(not source.available(), reason="aiconfigurator-core is not installed")
def test_parquet_columns_read_as_pyarrows_to_numpy_gives_them():
    """Protects the measured cost model: the columns come from the buffers, not pyarrow's pandas-backed to_numpy."""
    import pyarrow.parquet as pq

    for op, fw, name in (("gemm", "vllm", "gemm_perf.parquet"),
                         ("attention", "vllm", "context_attention_perf.parquet"),
                         ("comm", "nccl", "nccl_perf.parquet")):
        ref = source.find_table("h100_sxm", op, fw, name)
        names = tuple(pq.read_schema(ref.path).names)
        source.clear_read_cache()
        got = source.read_columns(ref.path, names)
        table = pq.read_table(ref.path, columns=list(names))
        for c in names:
            want = table.column(c).to_numpy(zero_copy_only=False)
            assert got[c].dtype == want.dtype and np.array_equal(got[c], want), (name, c)
