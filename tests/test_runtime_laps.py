"""LAPS served for real: `tandem serve --policy laps` with 2 prefill workers and 1 decode worker runs the same
factory-built cores as the simulator: the two prefill workers form a short and a long pool, every short round's
prefill runs on the short pool's worker and every long one on the long pool's, through AWD batching, and every
round's greedy output equals the offline engine's; /metrics shows the pools, the batches and the queues."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.cluster import ClusterConfig  # noqa: E402
from live_server import LiveServer, one_thread_llm  # noqa: E402

MODEL = "tiny-laps"
ENGINE = dict(max_model_len=1024, num_kv_blocks=256)
LAPS_METRICS = ("tandem:laps_pool_short_workers", "tandem:laps_pool_long_workers", "tandem:laps_pool_moves_total",
                "tandem:laps_short_steps_total", "tandem:laps_graph_steps_total", "tandem:laps_short_waiting",
                "tandem:laps_long_waiting", "tandem:laps_awd_depth")
SHORT, LONG = 0, 1                  # initial pools: the lower prefill id short, the other long (2 prefill workers)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-laps")
    make_tiny_model(path, arch="qwen3", size="1m", seed=5)
    return str(path)


def complete_all(srv: LiveServer, prompts: list[list[int]]) -> list[list[int]]:
    """Send every prompt at once through /v1/completions (greedy, 5 tokens); the token ids of each answer."""
    async def one(c, prompt):
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                  "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    return asyncio.run_coroutine_threadsafe(main(), srv.loop).result(120)


def test_laps_serves_short_and_long_rounds_on_their_pools_with_offline_outputs(ckpt):
    """Protects LAPS in the live server: 6 short prompts (< 256 tokens) and 2 long ones (>= 256), sent at once;
    every completion equals the offline engine's greedy output, the short pool's worker ran exactly the 6 short
    prefills and the long pool's the 2 long ones (the coordinator's round records)."""
    shorts = [list(range(10 + i, 60 + 3 * i)) for i in range(6)]
    longs = [list(range(3, 300)), list(range(7, 400))]
    srv = LiveServer(ClusterConfig(ckpt, 2, 1, 0, "laps", served_model_name=MODEL, engine_args=ENGINE))
    try:
        got = complete_all(srv, shorts + longs)
        where = srv.call(lambda: [(r.rounds[0].prefill_where, r.rounds[0].prefill_worker)
                                  for r in srv.cluster.shell.coord.records])
        srv.wait_for("the prefill workers' states to show the short steps",
                     lambda: srv.metrics(LAPS_METRICS)["tandem:laps_short_steps_total"] >= 1)
        m = srv.metrics(LAPS_METRICS)
    finally:
        srv.stop()
    with one_thread_llm(ckpt, **ENGINE) as llm:
        want = [o.token_ids for o in llm.generate(shorts + longs, SamplingParams(temperature=0.0, max_tokens=5,
                                                                                  ignore_eos=True))]
    assert got == want
    assert sorted(where) == [("remote", SHORT)] * 6 + [("remote", LONG)] * 2
    assert (m["tandem:laps_pool_short_workers"], m["tandem:laps_pool_long_workers"]) == (1, 1)
    assert m["tandem:laps_pool_moves_total"] == 0
    assert m["tandem:laps_graph_steps_total"] == m["tandem:laps_short_steps_total"]   # <= 6 x < 256 tokens: a bucket
    assert (m["tandem:laps_short_waiting"], m["tandem:laps_long_waiting"]) == (0, 0)
    assert m["tandem:laps_awd_depth"] >= 1


def test_a_laps_server_on_a_profile_takes_the_boundary_fitted_to_it(ckpt, tmp_path):
    """Protects the live server's default threshold: `tandem serve --policy laps --perf PROFILE` classifies at the
    profile's fitted L_m (here the 309.6-token boundary of a known T(L, H), rounded up to 310), workers and
    coordinator alike; a set --laps-length-threshold wins; a profile without a fit leaves LAPS's 256."""
    from tandem.policy.laps.cost import PrefillCostModel, boundary_from_profile
    from tandem.runtime.cluster import ServingCluster

    truth = PrefillCostModel(alpha=1e-8, beta=1e-6, gamma_w=4096 / 1e9, gamma_r=2e-6)
    rows = [{"kind": "prefill", "num_prefill": 1, "num_decode": 0, "prefill_tokens": L, "prefill_kv_read_tokens": H,
             "seconds": truth.latency(L, H)} for L in (16, 64, 256, 1024) for H in (0, 512, 2048)]

    class Prof:
        measurements, kv_bytes_per_token, device = rows, 4096, {"memory_bandwidth_bytes_per_s": 1e9}
    assert boundary_from_profile(Prof) == 310
    Prof.device = {}
    assert boundary_from_profile(Prof) is None

    import tandem.perf.profile_io as pio
    real = pio.load_perf
    pio.load_perf = lambda path: type("P", (Prof,), {"device": {"memory_bandwidth_bytes_per_s": 1e9}})
    try:
        spec = ServingCluster(ClusterConfig(ckpt, 2, 1, 0, "laps", perf=str(tmp_path / "p.json"))).policy_spec()
        fixed = ServingCluster(ClusterConfig(ckpt, 2, 1, 0, "laps", perf="p.json",
                                             policy_options={"laps_length_threshold": 128})).policy_spec()
        plain = ServingCluster(ClusterConfig(ckpt, 2, 1, 0, "laps")).policy_spec()
    finally:
        pio.load_perf = real
    assert (spec.laps_length_threshold, fixed.laps_length_threshold, plain.laps_length_threshold) == (310, 128, None)


def test_ampd_laps_batches_a_decode_workers_short_local_prefills_live(ckpt, tmp_path):
    """Protects AWD on the local path in the live server: on a cost model whose KV transfers take 1000 s, AMPD's
    router keeps every round of `ampd+laps` on its decode worker (TTFT SLO 10 s); 6 short prompts sent at once are
    held by that worker's AWD and run in bucketed short steps (fewer steps than prompts), /metrics shows them, and
    every completion equals the offline engine's."""
    from tandem.perf.ampd_cost import AMPDCostModel
    from tandem.perf.fit import PiecewiseLinear

    perf = tmp_path / "profile.json"
    kv = PiecewiseLinear(1, [], [[1000.0, 0.0]])
    AMPDCostModel({1: PiecewiseLinear(1, [], [[0.0, 1e-4, 0.0, 0.0]])}, {1: PiecewiseLinear(1, [], [[1e-3, 0.0, 0.0]])},
                  {"1-1-node": kv, "1-1-net": kv}, meta={"source": "tests/test_runtime_laps.py"}).to_json(perf)
    shorts = [list(range(10 + i, 60 + 3 * i)) for i in range(6)]
    srv = LiveServer(ClusterConfig(ckpt, 1, 1, 0, "ampd+laps", served_model_name=MODEL, engine_args=ENGINE,
                                   perf=str(perf), slo_ttft_s=10.0))
    try:
        got = complete_all(srv, shorts)
        where = srv.call(lambda: [r.rounds[0].prefill_where for r in srv.cluster.shell.coord.records])
        srv.wait_for("the decode worker's state to show its short steps",
                     lambda: srv.metrics(LAPS_METRICS)["tandem:laps_short_steps_total"] >= 1)
        m = srv.metrics(LAPS_METRICS)
    finally:
        srv.stop()
    with one_thread_llm(ckpt, **ENGINE) as llm:
        want = [o.token_ids for o in llm.generate(shorts, SamplingParams(temperature=0.0, max_tokens=5,
                                                                          ignore_eos=True))]
    assert got == want
    assert where == ["local"] * 6
    assert 1 <= m["tandem:laps_short_steps_total"] < 6
    assert m["tandem:laps_graph_steps_total"] == m["tandem:laps_short_steps_total"]
    assert m["tandem:laps_short_waiting"] == 0
