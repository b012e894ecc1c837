"""Streaming a run's records (simulate(..., stream=RecordStream(path))): the same metrics as summarize() over the
records kept in memory, the same JSONL as dump_records, and no record left in the result; open and closed loop."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tandem.sim.cluster import SimConfig, simulate
from tandem.workload.generators import PAPER_SLOS, generate
from tandem.workload.metrics import RecordStream, summarize
from tandem.workload.records import dump_records

MODEL = "llama-3.1-70b"


@pytest.mark.parametrize("concurrency", [None, 5])
def test_streamed_records_give_the_same_metrics_and_lines(tmp_path, concurrency) -> None:
    """Protects the bounded-memory path of long runs: what it writes and reports equals the in-memory run's."""
    sessions = generate("toolbench", 40, 2.0, 0, slo=PAPER_SLOS[(MODEL, "toolbench")])
    cfg = SimConfig(MODEL, "h20", 8, "P:tp4x1,D:tp4x1", "ampd", seed=0, concurrency=concurrency)
    kept = simulate(sessions, cfg)
    dump_records(kept.records, tmp_path / "kept.jsonl")
    stream = RecordStream(tmp_path / "streamed.jsonl")
    streamed = simulate(generate("toolbench", 40, 2.0, 0, slo=PAPER_SLOS[(MODEL, "toolbench")]), cfg, stream=stream)
    stream.close()
    assert streamed.records == [] and kept.metrics is None
    assert (streamed.events, streamed.sim_time_s) == (kept.events, kept.sim_time_s)
    assert json.dumps(streamed.metrics, sort_keys=True) == json.dumps(summarize(kept.records, kept.sim_time_s),
                                                                      sort_keys=True)
    assert (tmp_path / "streamed.jsonl").read_text() == (tmp_path / "kept.jsonl").read_text()
    assert streamed.metrics["sessions_total"] == 40


def test_summarize_of_a_generator_equals_that_of_a_list() -> None:
    """summarize folds records in one pass: a generator and a list of the same records agree."""
    sessions = generate("gaia", 12, 1.0, 1, slo=PAPER_SLOS[(MODEL, "gaia")])
    res = simulate(sessions, SimConfig(MODEL, "h20", 32, "P:tp4x4,D:tp4x4", "ampd", seed=0))
    recs = [dataclasses.replace(r) for r in res.records]
    assert summarize((r for r in recs), res.sim_time_s) == summarize(recs, res.sim_time_s)
