"""Engine roles for PD disaggregation: a prefill engine computes on history KV read from a decode engine and
sends the new KV back; the decode engine continues. Outputs equal the co-located engine's (greedy)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tandem.core.types import FetchHistory, PrefillDone  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.kv_transfer import KVPayload, KVTransferError, export_kv, import_kv  # noqa: E402
from tandem.engine.llm import LLM  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-disagg")
    make_tiny_model(path, arch="qwen3", size="1m", seed=3)
    return str(path)


def engines(path):
    cfg = dict(model=path, max_num_batched_tokens=32, num_kv_blocks=64, max_model_len=1024)
    return (LLMEngine(EngineConfig(**cfg), role="prefill", worker_id=0),
            LLMEngine(EngineConfig(**cfg), role="decode", worker_id=1))


def run_until(engine, pred, limit=500):
    outs = []
    for _ in range(limit):
        outs += engine.step()
        if pred(outs):
            return outs
    raise AssertionError("engine did not get there")


def remote_round(p, d, rid, prompt, session="s", recompute=False):
    """Carry out what the coordinator's actions say for one remote round; returns the finished output. With
    `recompute` the prefill engine computes the history itself (vllm-pd) instead of reading it."""
    hist = d.begin_round(session)
    d.add_request(rid, prompt, GREEDY, session_id=session, remote=True)
    p.add_prefill(rid, prompt, GREEDY, session, l_hist=hist, hist_compute=hist if recompute else 0)
    fetched = False
    while True:
        p.step()
        evs, p.core_events = p.core_events, []
        for ev in evs:
            if isinstance(ev, FetchHistory):                        # history read lazily when the task starts
                assert ev.tokens == hist
                p.receive_kv(rid, d.export_history(session, hist))
                p.on_history_ready(rid)
                fetched = True
            elif isinstance(ev, PrefillDone):
                payload, tok, lps = p.export_new_kv(rid)
                assert payload.num_tokens == len(prompt) - hist      # only the new KV goes back
                d.receive_kv(rid, payload)
                outs = d.on_kv_arrived(rid, tok, lps)
                p.on_delivered(rid)
                assert fetched == (hist > 0 and not recompute)
                done = run_until(d, lambda o: any(x.finished for x in o)) if not any(o.finished for o in outs) else outs
                return [o for o in done if o.finished][0]


def test_remote_and_local_rounds_of_a_session_match_the_colocated_engine(tiny):
    p, d = engines(tiny)
    vocab = p.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    new = [torch.randint(3, vocab - 8, (k,), generator=g).tolist() for k in (40, 23, 9)]
    conv = list(new[0])
    got = []
    out = remote_round(p, d, "r0", conv)                                    # initial prefill, remote
    got.append(out.token_ids)
    conv = conv + out.token_ids + new[1]
    out = remote_round(p, d, "r1", conv)                                    # incremental, remote, history read
    assert out.num_cached_tokens == 40 + 12 - 1
    got.append(out.token_ids)
    conv = conv + out.token_ids + new[2]
    d.begin_round("s")
    d.add_request("r2", conv, GREEDY, session_id="s")                      # incremental, local on the decode worker
    out = [o for o in run_until(d, lambda o: any(x.finished for x in o)) if o.finished][0]
    got.append(out.token_ids)
    assert d.core.seqs["s"].num_tokens == len(conv) + 12 - 1
    assert p.core.blocks.num_free == p.core.blocks.num_blocks              # the prefill worker freed every block

    ref = LLM(tiny, max_num_batched_tokens=32)
    conv = list(new[0])
    want = []
    for k in range(3):
        o = ref.generate([conv], GREEDY)[0].token_ids                       # recomputed from scratch
        want.append(o)
        if k < 2:
            conv = conv + o + new[k + 1]
    assert got == want


def test_a_prefill_engine_that_recomputes_the_history_sends_the_same_kv_and_tokens(tiny):
    """Protects vllm-pd in the engine: a prefill worker sent the whole prompt (hist_compute = l_hist) reads no history,
    computes every position itself, sends back only the new tokens' KV, and the session's output equals the run that
    read its history; a hist_compute outside [0, l_hist] is refused."""
    outs = {}
    for recompute in (False, True):
        p, d = engines(tiny)
        vocab = p.model_config.vocab_size
        g = torch.Generator().manual_seed(1)
        new = [torch.randint(3, vocab - 8, (k,), generator=g).tolist() for k in (30, 17)]
        conv = list(new[0])
        first = remote_round(p, d, "r0", conv, recompute=recompute)
        conv = conv + first.token_ids + new[1]
        second = remote_round(p, d, "r1", conv, recompute=recompute)
        outs[recompute] = (first.token_ids, second.token_ids)
        assert p.core.blocks.num_free == p.core.blocks.num_blocks
    assert outs[True] == outs[False]
    p, _ = engines(tiny)
    with pytest.raises(EngineError, match="hist_compute"):
        p.add_prefill("bad", list(range(3, 40)), GREEDY, "s", l_hist=10, hist_compute=11)


def test_kv_payload_round_trips_through_bytes_between_caches(tiny):
    p, d = engines(tiny)
    caches = p.runner.kv_caches
    for c in caches:
        c.normal_()
    payload = export_kv(caches, [5, 2, 9], 16, 3, 40)
    again = KVPayload.from_buffer(bytes(payload.buffer()), payload.num_tokens, payload.dtype, payload.shape)
    import_kv(d.runner.kv_caches, [7, 1, 3], 16, 3, again)
    back = export_kv(d.runner.kv_caches, [7, 1, 3], 16, 3, 40)
    assert torch.equal(back.data, payload.data) and back.num_tokens == 37
    with pytest.raises(KVTransferError, match="does not fit"):
        import_kv(d.runner.kv_caches[:2], [7, 1, 3], 16, 3, again)
    with pytest.raises(KVTransferError, match="bytes"):
        KVPayload.from_buffer(b"\0" * 10, payload.num_tokens, payload.dtype, payload.shape)


def test_an_aborted_remote_prefill_frees_its_blocks(tiny):
    p, d = engines(tiny)
    p.add_prefill("x", list(range(5, 60)), GREEDY, "s", l_hist=20)
    p.step()                                                                # admitted, waits for its history
    assert p.core.blocks.num_free < p.core.blocks.num_blocks
    p.abort_request("x")
    assert p.core.blocks.num_free == p.core.blocks.num_blocks and not p.requests


def test_roles_refuse_the_other_roles_calls(tiny):
    p, d = engines(tiny)
    with pytest.raises(EngineError, match="add_prefill"):
        p.add_request("a", [5, 6, 7], GREEDY)
    with pytest.raises(EngineError, match="prefill worker"):
        d.add_prefill("a", [5, 6, 7], GREEDY, "s", l_hist=0)
    with pytest.raises(EngineError, match="has 0 tokens"):
        d.export_history("nobody", 4)
