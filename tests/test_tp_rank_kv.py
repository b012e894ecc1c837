"""KV between engines of different tensor-parallel degrees moved rank to rank (parallel/kv_ranks.py over the runtime's
authenticated endpoints, runtime/rank_kv.py): every rank of each engine (the rank processes included) opens its own
KV endpoint with the cluster's CURVE keys; a session's history read from the decode engine and the new KV sent back
go from each sending rank to the receiving ranks that hold the heads, never through a driver. The decode engine's
KV equals the tp=1 pair's, greedy tokens equal the tp=1 engine's, each rank received exactly its heads' share, and
a transfer that misses a rank fails whole (no rank keeps any of it; the request is still there); rank endpoints that
cannot be reached make the worker send that transfer, and later ones to them, driver to driver."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")

from tandem.core.types import FetchHistory, PrefillDone  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.kv_transfer import KVTransferError  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.parallel import group  # noqa: E402
from tandem.engine.parallel.head_map import kv_head_spans  # noqa: E402
from tandem.engine.parallel.kv_stage import HeadPart, KVStaging  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime import messages as m  # noqa: E402
from tandem.runtime.kv_send import KVSender  # noqa: E402
from tandem.runtime.rank_kv import endpoint_factory  # noqa: E402
from tandem.runtime.transport import Keys, WorkerAuth, curve_available  # noqa: E402
from tp_helpers import needs_two_cores, three_round_reference  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PART = 16                       # tokens per rank-to-rank message: the 37-token first round goes in three parts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tp-rank-kv")
    make_tiny_model(path, arch="qwen3", size="1m", seed=3)
    return str(path)


@pytest.fixture(scope="module")
def factory():
    auth = WorkerAuth(0, b"", Keys.new(), Keys.new(), Keys.new()) if curve_available() else None
    return endpoint_factory(auth, "127.0.0.1", 8 << 20, send_timeout_s=1.0)


def _engine(path: str, role: str, wid: int, tp: int, factory) -> tuple[LLMEngine, list[str]]:
    e = LLMEngine(EngineConfig(model=path, max_num_batched_tokens=32, num_kv_blocks=64, max_model_len=512,
                               tensor_parallel_size=tp), role=role, worker_id=wid)
    return e, e.runner.open_kv_plane(factory)


def _move(src: LLMEngine, dst: LLMEngine, dst_addrs: list[str], purpose: str, rid: str, tokens: int, sent: list):
    transfer = f"{rid}/{purpose}"
    n, tok, lps, nbytes = src.send_kv_ranks(purpose, "s", rid, tokens, transfer, dst_addrs, PART)
    dst.receive_staged(rid, transfer, n)
    sent.append((purpose, n, nbytes))
    return tok, lps


def _session(p, pa, d, da, news):
    conv, got, cached, sent = [], [], [], []
    for k, new in enumerate(news):
        conv = conv + new
        rid = f"r{k}"
        hist = d.begin_round("s")
        d.add_request(rid, conv, GREEDY, session_id="s", remote=True)
        p.add_prefill(rid, conv, GREEDY, "s", l_hist=hist)
        out = None
        for _ in range(500):
            p.step()
            evs, p.core_events = p.core_events, []
            for ev in evs:
                if isinstance(ev, FetchHistory):
                    _move(d, p, pa, "history", rid, hist, sent)
                    p.on_history_ready(rid)
                elif isinstance(ev, PrefillDone):
                    tok, lps = _move(p, d, da, "incremental", rid, 0, sent)
                    outs = d.on_kv_arrived(rid, tok, lps)
                    p.on_delivered(rid)
                    while not any(o.finished for o in outs):
                        outs = d.step()
                    out = next(o for o in outs if o.finished)
            if out is not None:
                break
        got.append(out.token_ids)
        cached.append(out.num_cached_tokens)
        conv = conv + out.token_ids
    return got, cached, sent


@pytest.fixture(scope="module")
def reference(tiny, factory):
    """Three rounds' new tokens, the tp=1 co-located engine's tokens, and the tp=1 pair's decode engine (KV moved
    over the endpoints too: one rank each)."""
    news, want = three_round_reference(tiny, GREEDY)
    p1, pa = _engine(tiny, "prefill", 0, 1, factory)
    d1, da = _engine(tiny, "decode", 1, 1, factory)
    got, cached, sent = _session(p1, pa, d1, da, news)
    assert got == want
    yield news, want, cached, sent, d1
    p1.close()
    d1.close()


@needs_two_cores
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (4, 1), (1, 4)])
def test_kv_moves_rank_to_rank_and_equals_one_rank(tiny, factory, reference, monkeypatch, p_tp, d_tp):
    """Protects rank-to-rank KV (two engines of one process: a tp=2 group's rank 1 is a real process with its own
    endpoint): over three rounds the decode engine's whole KV equals the tp=1 pair's (float tolerance of the
    all-reduce's order), tokens and cached tokens equal tp=1, no driver gathered or scattered a byte, and each
    rank's endpoint received exactly its heads' share of what was sent to its engine. At tp=4 the tiny Qwen3's 2 KV
    heads are replicated on two ranks each: every replica receives its head, and a replicated head is sent by one
    holder only (the senders' bytes add up to every head once)."""
    monkeypatch.setattr(group, "usable_cpus", lambda: 4)        # tp=4: four rank processes on this machine's cores
    news, want, cached_ref, sent_ref, d1 = reference
    p, pa = _engine(tiny, "prefill", 0, p_tp, factory)
    d, da = _engine(tiny, "decode", 1, d_tp, factory)
    try:
        assert (len(pa), len(da)) == (p_tp, d_tp)
        got, cached, sent = _session(p, pa, d, da, news)
        pb, db = p.runner.kv_bytes(), d.runner.kv_bytes()           # before the check's own gather below
        n = d1.core.seqs["s"].num_tokens
        torch.testing.assert_close(d.export_history("s", n).data, d1.export_history("s", n).data,
                                   atol=1e-4, rtol=1e-4)
    finally:
        p.close()
        d.close()
    assert got == want and cached == cached_ref
    assert [s[:2] for s in sent] == [s[:2] for s in sent_ref]
    assert pb["driver"] == 0 and db["driver"] == 0
    # the payload (every KV head once) of each direction, as the tp=1 pair sent it
    payload = {k: sum(b for kind, _, b in sent_ref if kind == k) for k in ("history", "incremental")}
    for eng, tp, purpose in ((pb, p_tp, "history"), (db, d_tp, "incremental")):
        shares = [count / 2 for _, count in kv_head_spans(2, tp)]     # the tiny Qwen3 has 2 KV heads
        assert [eng[f"received/{r}"] for r in range(tp)] == [payload[purpose] * sh for sh in shares]
    # each head once from one holder, to every rank that holds it on the receiving side
    assert sum(pb[f"sent/{r}"] for r in range(p_tp)) == payload["incremental"] * max(1, d_tp // 2)
    assert sum(db[f"sent/{r}"] for r in range(d_tp)) == payload["history"] * max(1, p_tp // 2)

@needs_two_cores
def test_a_transfer_missing_a_rank_fails_whole_and_keeps_the_request(tiny, factory, reference):
    """Protects all-or-nothing: parts that reach only the decode driver (rank 1's heads never sent) make the claim
    fail with one line naming the rank, neither rank keeps any of it, and the request is still held (the runtime
    then reports a failed transfer, as on the driver path)."""
    news = reference[0]
    d, da = _engine(tiny, "decode", 1, 2, factory)
    try:
        d.add_request("r0", news[0], GREEDY, session_id="s", remote=True)
        plane = d.runner.kv_plane
        part = HeadPart("t0", 0, 0, 1, 0, 5, 5, "float32")
        layers, hd = d.model_config.num_hidden_layers, d.model_config.head_dim
        plane.own.staging.add(part, bytearray(layers * 2 * 5 * hd * 4))
        with pytest.raises(KVTransferError, match=r"^rank 1 did not receive its KV heads of a 5-token transfer"):
            d.runner.kv_plane.claim("t0", 5, wait_s=0.2)
        assert len(plane.own.staging) == 0 and "r0" in d.requests and "r0" not in d.kv.inbox
    finally:
        d.close()


def test_staging_refuses_what_is_not_this_ranks():
    """Protects the receiving side's checks: a part of another rank's heads, of another dtype, overrunning its
    transfer, longer than max_model_len, of the wrong size, or repeating cells is refused with one line and
    nothing is kept; a complete transfer is claimed, taken once, then gone."""
    st = KVStaging(layers=2, first=1, count=1, head_dim=4, dtype=torch.float32, max_tokens=64)
    ok = HeadPart("t", 0, 1, 1, 0, 3, 6, "float32")
    size = 2 * 2 * 3 * 4 * 4
    for part, n, msg in [(HeadPart("t", 0, 0, 1, 0, 3, 6, "float32"), size, "not this rank's"),
                         (HeadPart("t", 0, 1, 1, 0, 3, 6, "float16"), size // 2, "of float16"),
                         (HeadPart("t", 0, 1, 1, 4, 3, 6, "float32"), size, "of a 6-token transfer"),
                         (HeadPart("t", 0, 1, 1, 0, 3, 65, "float32"), size, "at most 64 here"),
                         (ok, size - 4, "its header says")]:
        with pytest.raises(KVTransferError, match=msg):
            st.add(part, bytearray(n))
    assert len(st) == 0 and st.received_bytes == 0
    st.add(ok, bytearray(size))
    with pytest.raises(KVTransferError, match="repeating cells"):
        st.add(ok, bytearray(size))
    assert st.claim_all("t", 6, 0, 0.0) == (-1, [0]) and len(st) == 0        # incomplete: dropped
    st.add(ok, bytearray(size))
    st.add(HeadPart("t", 1, 1, 1, 3, 3, 6, "float32"), bytearray(size))
    assert not st.ready("t", 6, 1)                                 # rank 1 has not reported its heads
    st.note_remote("t", 1, 7, (0, 7))
    assert st.ready("t", 6, 1) and st.claim_all("t", 6, 1, 0.0) == (2 * size + 7, [])
    assert st.received_bytes == 3 * size and st.remote_counts == {1: (0, 7)}
    assert st.take("t").shape == (2, 2, 6, 1, 4)
    with pytest.raises(KVTransferError, match="no claimed KV transfer"):
        st.take("t")


def test_unreachable_rank_endpoints_fall_back_to_the_driver_path(reference):
    """Protects the fallback: a SendKV naming rank endpoints nobody listens on (as when a peer's ranks cannot be
    reached across hosts) fails its rank-to-rank send within the endpoint's send timeout, and the same transfer goes
    driver to driver (KVData in 16-token parts, every byte counted on the driver path); the next transfer to those
    endpoints goes driver to driver at once."""
    from live_server import free_port
    d1 = reference[4]
    sent: list = []
    sender = KVSender(d1, 1, lambda addr, msg, *bufs, delay_s=0.0: sent.append((addr, msg, bufs)), time.time, [],
                      PART)
    msg = m.SendKV("rx", "s", "history", 40, 0, "tcp://127.0.0.1:9",
                   [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)])
    mc = d1.model_config
    per_token = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 4
    for most_s in (3.0, 0.5):
        t0 = time.monotonic()
        sender.send(msg)
        took = time.monotonic() - t0
        assert [(type(h).__name__, h.offset, h.num_tokens) for _, h, _ in sent] == \
            [("KVData", 0, 16), ("KVData", 16, 16), ("KVData", 32, 8)]
        assert took < most_s
        sent.clear()
    assert sender.driver_bytes == 2 * 40 * per_token
