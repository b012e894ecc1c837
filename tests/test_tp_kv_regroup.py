"""A session's KV between engines of different tensor-parallel degrees (a prefill engine at tp=a, a decode engine
at tp=b, in one process; each rank holds its own KV heads): the history read from the decode engine and the new KV
sent back regroup on the way, and the session's greedy tokens equal the tp=1 co-located engine's, for a < b and
a > b, with the tiny Qwen3's 2 KV heads split (tp=2) and replicated (tp=4, its cores faked: four rank processes on
this machine's cores)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from tandem.core.types import FetchHistory, PrefillDone  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.kv_transfer import export_kv  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.parallel import group  # noqa: E402
from tandem.engine.parallel.head_map import kv_head_spans  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tp_helpers import needs_two_cores, three_round_reference  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tp-kv")
    make_tiny_model(path, arch="qwen3", size="1m", seed=3)
    return str(path)


def _engine(path: str, role: str, wid: int, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, max_num_batched_tokens=32, num_kv_blocks=64, max_model_len=512,
                                  tensor_parallel_size=tp), role=role, worker_id=wid)


def _remote_round(p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int], wire: list):
    """One remote round as the coordinator runs it: history KV from the decode engine to the prefill engine, the
    new KV back; every payload kept in `wire`. Returns the finished output."""
    hist = d.begin_round("s")
    d.add_request(rid, prompt, GREEDY, session_id="s", remote=True)
    p.add_prefill(rid, prompt, GREEDY, "s", l_hist=hist)
    for _ in range(500):
        p.step()
        evs, p.core_events = p.core_events, []
        for ev in evs:
            if isinstance(ev, FetchHistory):
                payload = d.export_history("s", hist)
                wire.append(payload)
                p.receive_kv(rid, payload)
                p.on_history_ready(rid)
            elif isinstance(ev, PrefillDone):
                payload, tok, lps = p.export_new_kv(rid)
                wire.append(payload)
                d.receive_kv(rid, payload)
                outs = d.on_kv_arrived(rid, tok, lps)
                p.on_delivered(rid)
                for _ in range(500):
                    done = [o for o in outs if o.finished]
                    if done:
                        return done[0]
                    outs = d.step()
    raise AssertionError("the round did not finish")


def _session(p: LLMEngine, d: LLMEngine, news: list[list[int]]):
    conv, got, cached, wire = [], [], [], []
    for k, new in enumerate(news):
        conv = conv + new
        out = _remote_round(p, d, f"r{k}", conv, wire)
        got.append(out.token_ids)
        cached.append(out.num_cached_tokens)
        conv = conv + out.token_ids
    return got, cached, wire


@pytest.fixture(scope="module")
def reference(tiny):
    """The tp=1 co-located engine's tokens for a three-round session, and the tp=1 P/D pair's wire payloads."""
    news, want = three_round_reference(tiny, GREEDY)
    d1 = _engine(tiny, "decode", 1, 1)
    got, cached, wire = _session(_engine(tiny, "prefill", 0, 1), d1, news)
    assert got == want
    return news, want, cached, wire, d1


def _ranks_left() -> list:
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(c.cmdline())
            if "forkserver" not in cmd and "resource_tracker" not in cmd and c.status() != psutil.STATUS_ZOMBIE:
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


@needs_two_cores
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (4, 1), (1, 4)])
def test_kv_regroups_between_degrees_and_tokens_equal_one_rank(tiny, reference, monkeypatch, p_tp, d_tp):
    """Protects the regrouping (parallel/head_map.py, parallel/kv_group.py): over three rounds of one session, the
    history read from the decode engine and the new KV sent back carry every KV head once in head order (the tp=1
    pair's shapes, values within the all-reduce's float order), each rank of the tp>1 engine takes exactly its heads,
    the decode engine reuses the transferred KV (cached tokens as at tp=1), the session's whole KV as the decode
    engine's ranks hold it equals the tp=1 decode engine's (the driver's own cache holding exactly its heads of it),
    and greedy tokens equal the tp=1 engine's."""
    monkeypatch.setattr(group, "usable_cpus", lambda: 4)
    news, want, cached_ref, wire_ref, d1 = reference
    p, d = _engine(tiny, "prefill", 0, p_tp), _engine(tiny, "decode", 1, d_tp)
    try:
        got, cached, wire = _session(p, d, news)
        n = d1.core.seqs["s"].num_tokens
        assert d.core.seqs["s"].num_tokens == n
        # the session's whole KV as the decode engine's ranks hold it (each its heads: received, then decoded)
        resident = d.export_history("s", n)
        torch.testing.assert_close(resident.data, d1.export_history("s", n).data, atol=1e-4, rtol=1e-4)
        first, count = kv_head_spans(2, d_tp)[0]
        seq = d.core.seqs["s"]
        own = export_kv(d.runner.kv_caches, d.core.blocks.tables[seq], d.config.block_size, 0, n)   # the driver's heads
        assert own.shape[3] == count and torch.equal(own.data, resident.data[:, :, :, first:first + count])
    finally:
        p.close()
        d.close()
    assert got == want
    assert cached == cached_ref and cached[1:] == [37 + 10 - 1, 37 + 10 + 21 + 10 - 1]
    assert [w.shape for w in wire] == [w.shape for w in wire_ref]
    assert all(w.shape[3] == 2 for w in wire)                          # every KV head once, at any degree
    for a, b in zip(wire, wire_ref):
        torch.testing.assert_close(a.data, b.data, atol=1e-4, rtol=1e-4)
    assert _ranks_left() == []
