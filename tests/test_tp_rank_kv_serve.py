"""The live server moves KV rank to rank between prefill and decode workers of any tensor-parallel degrees (tiny Qwen3,
2 KV heads, on CPU; every prefill remote, so each later round's history goes decode -> prefill and the new KV back):
greedy tokens equal the tp=1 offline engine's, no KV byte passes through a driver process (tandem:
kv_driver_path_bytes is 0 on every worker), and each rank's endpoint received exactly its heads' share of the KV its
worker was sent, counted from the rounds' token counts. Between two tp=1 workers KV still goes driver to driver.
GET /status and the start banner give the deployment as given and each worker's role, degree and processes."""
from __future__ import annotations

import asyncio

import httpx
import pytest

torch = pytest.importorskip("torch")

from tandem.bench.serve_client import parse_kv_paths  # noqa: E402
from tandem.cli.serve_cmd import deployment_lines  # noqa: E402
from tandem.engine.parallel.head_map import kv_head_spans  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.cluster import ClusterConfig  # noqa: E402

from live_server import LiveServer  # noqa: E402
import tp_helpers  # noqa: E402
from tp_helpers import needs_two_cores  # noqa: E402

MODEL, ENGINE = tp_helpers.SERVED_MODEL, tp_helpers.SERVE_ENGINE
tiny, offline = tp_helpers.tiny, tp_helpers.offline   # the shared module fixtures
SESSIONS, NEW, OUT = 2, (29, 13, 7), 6


def _rounds(url: str, vocab: int) -> list[tuple[list[int], list[int], int]]:
    """SESSIONS concurrent sessions of len(NEW) rounds: (prompt, output tokens, cached tokens) per round."""
    g = torch.Generator().manual_seed(11)
    news = [[torch.randint(3, vocab - 8, (n,), generator=g).tolist() for n in NEW] for _ in range(SESSIONS)]

    async def one(c: httpx.AsyncClient, i: int) -> list:
        conv, out = [], []
        for new in news[i]:
            conv = conv + new
            r = await c.post("/v1/completions", headers={"x-session-id": f"s{i}"},
                             json={"model": MODEL, "prompt": conv, "max_tokens": OUT, "temperature": 0,
                                   "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            d = r.json()
            out.append((list(conv), d["choices"][0]["token_ids"], d["usage"]["prompt_tokens_details"]["cached_tokens"]))
            conv = conv + out[-1][1]
        return out

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(SESSIONS)))
    return [r for s in asyncio.run(go()) for r in s]


@needs_two_cores
@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 2), (1, 1)], ids=["P1-D2", "P2-D1", "P2-D2", "P1-D1"])
def test_kv_goes_rank_to_rank_in_the_live_server(tiny, offline, p_tp, d_tp):
    """Protects rank-to-rank KV in `tandem serve`: every round's greedy tokens equal the tp=1 engine's; with a tp>1
    worker on either side the drivers carried 0 KV bytes and each rank of each worker received exactly its heads'
    share of the history (prefill worker) or new KV (decode worker) that the rounds' token counts give, and the
    senders' ranks sent the same in all; tp=1 to tp=1 keeps the driver path (all bytes through both drivers)."""
    srv = LiveServer(ClusterConfig(tiny, 1, 1, 0, "dynamo", served_model_name=MODEL, engine_args=ENGINE,
                                   role_tp={"prefill": p_tp, "decode": d_tp}))
    mc = offline.engine.model_config
    per_token = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 4       # float32 KV, every head
    seen: list = []

    def settled(total: float) -> bool:
        """Both workers reported, and their counts add up to every byte of the rounds' KV (reports lag a little)."""
        seen[:] = parse_kv_paths(httpx.get(srv.url + "/metrics").text)
        ranks, driver = seen
        return len(driver) == 2 and sum(driver.values()) + sum(ranks.values()) == 2 * total
    try:
        status = httpx.get(srv.url + "/status").json()
        banner = deployment_lines(status)
        rounds = _rounds(srv.url, mc.vocab_size)
        history = sum(cached for _, _, cached in rounds) * per_token                # decode -> prefill (worker 0)
        new = sum(len(p) - cached for p, _, cached in rounds) * per_token          # prefill -> decode (worker 1)
        try:
            srv.wait_for("the workers' KV byte counts", lambda: settled(history + new), 5)
        except AssertionError:
            pass                                          # the exact assertions below say what is off
        ranks, driver = seen
    finally:
        srv.stop()
    assert status["deploy"] == f"P:tp{p_tp}x1,D:tp{d_tp}x1"
    ranked = p_tp > 1 or d_tp > 1                     # between tp=1 workers no rank opens a KV endpoint
    assert [(w["worker"], w["role"], w["tensor_parallel_size"], len(w["rank_pids"]), w["kv_rank_endpoints"])
            for w in status["workers"]] == [(0, "prefill", p_tp, p_tp - 1, p_tp * ranked),
                                            (1, "decode", d_tp, d_tp - 1, d_tp * ranked)]
    w1 = status["workers"][1]
    ranks_text = f"pids {w1['pid']} driver, {w1['rank_pids'][0]} rank 1" if d_tp == 2 else f"pid {w1['pid']}"
    kv_text = "a KV endpoint per rank" if ranked else "KV through its driver only"
    assert banner[0] == f"tandem: deployment P:tp{p_tp}x1,D:tp{d_tp}x1"
    assert banner[2] == f"tandem: decode worker 1: tp{d_tp} ({ranks_text}; {kv_text})"
    refs = offline.generate([p for p, _, _ in rounds], SamplingParams(temperature=0.0, max_tokens=OUT,
                                                                      ignore_eos=True))
    assert [o for _, o, _ in rounds] == [r.outputs[0].token_ids for r in refs]
    if p_tp == d_tp == 1:
        assert driver == {0: history + new, 1: history + new} and not any(ranks.values())
        return
    assert driver == {0: 0.0, 1: 0.0}
    for wid, tp, got, gave in ((0, p_tp, history, new), (1, d_tp, new, history)):
        shares = [count / mc.num_key_value_heads for _, count in kv_head_spans(mc.num_key_value_heads, tp)]
        assert [ranks[(wid, "received", r)] for r in range(tp)] == [got * s for s in shares]
        assert sum(ranks[(wid, "sent", r)] for r in range(tp)) == gave


@needs_two_cores
def test_a_partial_rank_to_rank_transfer_falls_back_to_a_local_recompute(tiny, offline):
    """Protects all-or-nothing in the live server: the prefill worker's first transfer sends every part to the tp=2
    decode group's first rank (which refuses rank 1's heads, so rank 1 never completes); the decode worker gives up
    after its claim wait (0.5 s here) and reports the transfer failed, the coordinator's core falls back as for a
    transfer that timed out (the round routed remote is prefilled again on the decode worker: one KV fallback), and
    every round's greedy tokens still equal the tp=1 engine's; the session is not lost (its next round reuses its
    KV)."""
    srv = LiveServer(ClusterConfig(tiny, 1, 1, 0, "dynamo", served_model_name=MODEL, engine_args=ENGINE,
                                   role_tp={"prefill": 1, "decode": 2},
                                   worker_kwargs={0: {"kv_send_faults": ["partial"]}, 1: {"kv_claim_wait_s": 0.5}}))
    try:
        rounds = _rounds(srv.url, offline.engine.model_config.vocab_size)
        m = srv.metrics()
    finally:
        srv.stop()
    refs = offline.generate([p for p, _, _ in rounds], SamplingParams(temperature=0.0, max_tokens=OUT,
                                                                      ignore_eos=True))
    assert [o for _, o, _ in rounds] == [r.outputs[0].token_ids for r in refs]
    assert m["tandem:kv_transfer_timeouts_total"] == 1 and m["tandem:lost_requests_total"] == 0
    assert (m["tandem:remote_prefills_total"], m["tandem:local_prefills_total"]) == (SESSIONS * len(NEW), 0)
    later = [r for i, r in enumerate(rounds) if i % len(NEW)]
    assert all(cached == len(prev[0]) + len(prev[1]) - 1 for prev, (_, _, cached) in
               zip([r for i, r in enumerate(rounds) if i % len(NEW) != len(NEW) - 1], later))
