"""The live server runs exactly what the simulator runs: the policy named on `tandem serve --policy` is the policy
the live workers' cores schedule with, and it decides as the simulator's cores decide for the same arrivals.

1. `--policy ampd` (1 prefill + 1 decode worker, a `--perf` cost model written here so that the decisions do not
   hinge on real CPU timings): a long blocker B occupies a worker while a long round L and two short ones S1, S2
   queue behind it, in that order. AMPD Alg. 2 (TTFTAwareReorder) postpones L, which misses its TTFT SLO in any
   order, so S1 and S2 meet theirs. The order in which the live rounds get their first tokens must equal the order
   the simulator (tandem.sim.loop.EventLoop over cores built by tandem.core.factory with the same PolicySpec, cost
   model, scheduler knobs and arrivals) predicts, and differ from FCFS (the simulator's prediction for ampd-no-pr).
   Once with the queue on the decode worker (local prefills), once on the prefill worker (remote prefills: the
   round's TTFT SLO travels with AddPrefill).
2. `--policy continuum` vs `--policy vllm` (one co-located worker, 16 KV blocks): session A's idle KV survives the
   memory pressure of two concurrent sessionless requests under continuum (pinned for retain_idle_kv_s = 30 s: the
   second request waits for the first to finish instead), and is evicted under vllm (LRU), so A's next round reports
   its whole resident history as cached tokens under continuum and none under vllm.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("torch")

from tandem.core.config import SchedulerConfig  # noqa: E402
from tandem.core.factory import build_coordinator, build_worker  # noqa: E402
from tandem.core.state import InProcessState  # noqa: E402
from tandem.core.types import DECODE, PREFILL  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.perf.ampd_cost import AMPDCostModel  # noqa: E402
from tandem.perf.fit import PiecewiseLinear  # noqa: E402
from tandem.policy.presets import get_policy  # noqa: E402
from tandem.runtime.cluster import ClusterConfig, ServingCluster  # noqa: E402
from tandem.runtime.costs import serving_cost_model  # noqa: E402
from tandem.sim.loop import EventLoop  # noqa: E402
from tandem.sim.network import Network  # noqa: E402
from tandem.workload.session import SLO, Round, Session  # noqa: E402

BS = 16                                    # KV block size (the engine's default)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-policy-live")
    make_tiny_model(path, arch="qwen3", size="1m", seed=7)
    return str(path)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tokens(start: int, n: int) -> list[int]:
    """n token ids inside the tiny vocabulary (448 ids), starting at `start`."""
    return [10 + (start + i) % 400 for i in range(n)]


async def _until(what: str, pred, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


async def _drain(gen) -> list:
    """Every RequestOutput of one request (cumulative snapshots), the last one finished."""
    outs = []
    async for o in gen:
        outs.append(o)
    return outs


# ---------------------------------------------------------------------------- 1. ampd: Alg. 2 live == simulated
BLOCKER, LONG, SHORT = 2000, 1000, 48      # prompt tokens of the blocker B, the long round L, the short S1, S2
CHUNK = 8                                  # max_num_batched_tokens: S takes 6 steps, B 250, L 125
STEP_FLOOR_S = 0.003                       # every step of the queue's worker at least this much slower: B >= 0.75 s
                                           # on any machine (at 2 ms a chunk unslowed, B took 0.50 s on a fast VM, at
                                           # the 0.48 s where L can still meet its SLO: the order flipped)
AMPD_ENGINE = dict(max_model_len=2048, num_kv_blocks=512, max_num_batched_tokens=CHUNK)
P, D = 0, 1                                # worker ids of the 1P+1D cluster


@dataclass(frozen=True)
class Scenario:
    """Where the queue forms, the TTFT SLO, and the `--perf` cost model (T_pre piecewise in l_incr, T_kv flat)."""

    where: str                             # "local": the decode worker's queue; "remote": the prefill worker's
    slo_ttft_s: float
    pre: PiecewiseLinear
    kv_s: float
    expect: dict                           # est_s each round must get: B, L, S

    @property
    def worker(self) -> int:
        return D if self.where == "local" else P

    def write_profile(self, path) -> str:
        dec = PiecewiseLinear(1, [], [[1e-3, 0.0, 0.0]])
        kv = PiecewiseLinear(1, [], [[self.kv_s, 0.0]])
        AMPDCostModel({1: self.pre}, {1: dec}, {"1-1-node": kv, "1-1-net": kv},
                      meta={"source": "tests/test_policy_live.py"}).to_json(path)
        return str(path)


# Local: T_pre = 20 ms per new token (L 20 s, S 0.96 s) and the SLO 10 s: L misses in any order, S1 and S2 meet
# theirs only ahead of it (for any real wait below 8 s). T_kv = 1000 s: AMPD routing (Alg. 1) keeps every prefill
# on the decode worker whatever the published queues say (line 6: the local cost is the lowest).
LOCAL = Scenario("local", 10.0, PiecewiseLinear(1, [], [[0.0, 0.02, 0.0, 0.0]]), 1000.0,
                 {"B": 40.0, "L": 20.0, "S": 0.96})
# Remote: the prefill worker must have slack for every round whatever its published queue (Alg. 1 lines 1-3:
# est + T_kv + queue <= 0.9 x 4 s, at most 3.541 s), so the blocker's estimate is tiny (T_pre piecewise in l_incr);
# L (3.5 s) meets the 4 s SLO only if it starts within 0.5 s, S1 and S2 (10 ms) meet theirs ahead of it: after the
# blocker's 250 chunks of 8 tokens, each at least STEP_FLOOR_S slower (>= 0.75 s whatever the machine's speed),
# Alg. 2 puts them first (any wait in (0.48 s, 3.98 s)).
REMOTE = Scenario("remote", 4.0, PiecewiseLinear(1, [500.0, 1500.0], [[0.0, 0.01 / SHORT, 0.0, 0.0],
                                                                      [0.0, 3.5 / LONG, 0.0, 0.0],
                                                                      [0.0, 0.02 / BLOCKER, 0.0, 0.0]]), 1e-3,
                  {"B": 0.02, "L": 3.5, "S": 0.01})


class OrderMismatch(AssertionError):
    """The live order differs from the simulator's (every precondition held): the one expected failure."""


def _simulate(policy: str, sc: Scenario, cost, arrivals: dict[str, float], lengths: dict[str, int], step_s: float,
              kv_bytes_per_token: int) -> dict:
    """The simulator's run of the same rounds: cores from tandem.core.factory with `policy`, the workers' t_pre
    (worker_main's: the serving cost model at tp1), the live engine's scheduler knobs, one step every `step_s`."""
    sched = SchedulerConfig(block_size=BS, max_num_batched_tokens=CHUNK)

    def t_pre(h, n):
        return cost.t_pre(h, n, 1)

    nb = AMPD_ENGINE["num_kv_blocks"]
    workers = [build_worker(P, PREFILL, 1, nb, policy, sched, t_pre),
               build_worker(D, DECODE, 1, nb, policy, sched, t_pre)]
    state = InProcessState(workers, cost, [0, 0])
    coord = build_coordinator(state, get_policy(policy), sched, random.Random(0),
                              max_context=AMPD_ENGINE["max_model_len"])
    net = Network([0, 0], [1, 1], nvlink_bps=2e9, net_bps=2e9, nvlink_latency_s=1e-4, net_latency_s=1e-4,
                  schedule=None)
    loop = EventLoop(coord, workers, [lambda shape: step_s] * 2, net, kv_bytes_per_token)
    slo = SLO(sc.slo_ttft_s, math.inf)
    loop.run([Session(sid, at, [Round(lengths[sid], 1)], slo) for sid, at in arrivals.items()])
    return {r.session_id: r for r in coord.records}


def _reorder_live_vs_sim(ckpt: str, tmp_path, sc: Scenario) -> None:
    """B occupies the scenario's worker; L, S1, S2 queue behind it in that order (a published snapshot shows all
    three waiting, so the worker picks among all of them); the live first-token order must be the simulator's."""
    perf = sc.write_profile(tmp_path / "profile.json")
    cfg = ClusterConfig(ckpt, 1, 1, 0, "ampd", engine_args=AMPD_ENGINE, perf=perf, slo_ttft_s=sc.slo_ttft_s,
                        worker_kwargs={sc.worker: {"step_sleep_s": STEP_FLOOR_S}})
    lengths = {"B": BLOCKER, "L": LONG, "S1": SHORT, "S2": SHORT}
    prompts = {sid: _tokens(100 * i, n) for i, (sid, n) in enumerate(lengths.items())}
    kv_bytes = 2 * 4 * 2 * 48 * 4                              # K+V x layers x kv heads x head_dim x fp32
    cost = serving_cost_model(ckpt, kv_bytes, AMPD_ENGINE["max_model_len"], perf)   # what every process uses
    for sid, n in lengths.items():
        assert cost.t_pre(0, n, 1) == pytest.approx(sc.expect[sid[0]])

    async def main():
        c = await ServingCluster.start(cfg)
        try:
            def state():
                return c.shell.store.get(sc.worker)

            tasks = {"B": asyncio.create_task(_drain(c.generate(prompts["B"], _greedy(1), "B", session_id="B")))}
            await _until("the blocker's prefill to start", lambda: state().num_running >= 1)
            for i, sid in enumerate(("L", "S1", "S2")):           # one at a time: they queue in this order
                tasks[sid] = asyncio.create_task(_drain(c.generate(prompts[sid], _greedy(1), sid, session_id=sid)))
                await _until(f"{sid} to be queued", lambda i=i: state().num_waiting >= i + 1)
            queued = state()                                     # all three waiting: none picked yet
            blocker_running = not tasks["B"].done()
            outs = {sid: (await t)[-1] for sid, t in tasks.items()}
            recs = {r.session_id: r for r in c.shell.coord.records}
            return queued, blocker_running, outs, recs, c.stats()
        finally:
            await c.shutdown()

    t0 = time.monotonic()
    queued, blocker_running, outs, recs, stats = asyncio.run(main())
    live_s = time.monotonic() - t0
    assert queued.num_waiting == 3 and queued.num_running == 1 and blocker_running
    assert all(o.error is None and o.finished for o in outs.values())
    # AMPD routing sent every prefill to the scenario's worker
    assert {sid: (r.rounds[-1].prefill_where, r.rounds[-1].prefill_worker) for sid, r in recs.items()} == \
        {sid: (sc.where, sc.worker) for sid in lengths}
    assert (stats.local_prefills, stats.remote_prefills) == ((4, 0) if sc.where == "local" else (0, 4))
    first = {sid: o.metrics.first_token_time for sid, o in outs.items()}
    live_order = sorted(("L", "S1", "S2"), key=first.get)

    # the simulator, fed the same arrivals (offsets in the live coordinator's records) and the live blocker's time
    # per chunk, with the cost model every live process estimates with
    arrivals = {sid: r.rounds[0].arrival_s - recs["B"].rounds[0].arrival_s for sid, r in recs.items()}
    step_s = (first["B"] - outs["B"].metrics.arrival_time) / (BLOCKER // CHUNK)
    predicted = {}
    for policy in ("ampd", "ampd-no-pr"):
        sim = _simulate(policy, sc, cost, arrivals, lengths, step_s, kv_bytes)
        assert all((r.rounds[-1].prefill_where, r.rounds[-1].prefill_worker) == (sc.where, sc.worker)
                   and not r.failed for r in sim.values())
        predicted[policy] = sorted(("L", "S1", "S2"), key=lambda s: sim[s].rounds[0].first_token_s)
    print(f"\n{sc.where}: live order {live_order}, simulated ampd {predicted['ampd']}, "
          f"FCFS (ampd-no-pr) {predicted['ampd-no-pr']}; arrivals (s) "
          f"{ {k: round(v, 3) for k, v in arrivals.items()} }, blocker {step_s * 1e3:.1f} ms/chunk, live TTFT (s) "
          f"{ {s: round(first[s] - outs[s].metrics.arrival_time, 3) for s in first} }; cluster run {live_s:.1f} s")
    assert predicted["ampd-no-pr"] == ["L", "S1", "S2"]        # FCFS: arrival order
    assert predicted["ampd"] == ["S1", "S2", "L"]              # Alg. 2 postpones the long round
    if live_order != predicted["ampd"]:
        raise OrderMismatch(f"the live {sc.where} queue ran {live_order}, the simulator predicts {predicted['ampd']}")
    assert live_order != predicted["ampd-no-pr"]


def test_ampd_reorders_the_decode_workers_prefill_queue_as_the_simulator_predicts(ckpt, tmp_path):
    """The queue of local prefills on the decode worker (AddRequest carries the round's TTFT SLO)."""
    _reorder_live_vs_sim(ckpt, tmp_path, LOCAL)


def test_ampd_reorders_the_prefill_workers_queue_as_the_simulator_predicts(ckpt, tmp_path):
    """The queue of remote prefills on the prefill worker (AddPrefill carries the round's TTFT SLO)."""
    _reorder_live_vs_sim(ckpt, tmp_path, REMOTE)


# ---------------------------------------------------------------------------- 2. continuum pins, vllm evicts
KV_BLOCKS = 16
COLO_ENGINE = dict(max_model_len=KV_BLOCKS * BS, num_kv_blocks=KV_BLOCKS)
A_PROMPT, A_OUT = 80, 6                    # session A's round 1: 80 + 6 - 1 = 85 tokens resident, 6 blocks
X_PROMPT, X_OUT = 17, 79                   # grows to 95 tokens: 6 blocks, decoding long enough for Y to arrive
Y_PROMPT, Y_OUT = 150, 6                   # 155 tokens: 10 blocks, all the pool A leaves free


async def _pressure_run(ckpt: str, policy: str) -> dict:
    """Session A's round 1; two sessionless requests X, Y that together need more than A leaves free (each alone
    fits beside A): Y is sent once X has its first token, so X holds its KV and decodes while Y asks for 10 blocks;
    A's round 2 with its whole conversation resent, seconds later (far inside the 30 s TTL)."""
    t0 = time.monotonic()
    c = await ServingCluster.start(ClusterConfig(ckpt, 0, 0, 1, policy, engine_args=COLO_ENGINE))
    try:
        a1 = (await _drain(c.generate(_tokens(0, A_PROMPT), _greedy(A_OUT), "a1", session_id="A")))[-1]
        gx = c.generate(_tokens(150, X_PROMPT), _greedy(X_OUT), "x")
        first_x = await gx.__anext__()
        assert first_x.outputs[0].token_ids and not first_x.finished
        tx = asyncio.create_task(_drain(gx))
        y = (await _drain(c.generate(_tokens(200, Y_PROMPT), _greedy(Y_OUT), "y")))[-1]
        x = (await tx)[-1]
        conv = _tokens(0, A_PROMPT) + a1.outputs[0].token_ids + _tokens(380, 20)
        a2 = (await _drain(c.generate(conv, _greedy(4), "a2", session_id="A")))[-1]
    finally:
        await c.shutdown()
    out = dict(a1=a1, x=x, y=y, a2=a2, wall_s=time.monotonic() - t0)
    for k in ("a1", "x", "y", "a2"):
        assert out[k].error is None and out[k].finished, (policy, k, out[k].error)
    return out


def test_continuum_keeps_an_idle_sessions_kv_under_pressure_that_makes_vllm_evict_it(ckpt):
    assert get_policy("continuum").retain_idle_kv_s == 30.0 and get_policy("vllm").retain_idle_kv_s == 0.0
    policies = ("continuum", "vllm")

    async def both():                       # two independent servers at once (each one worker process)
        return dict(zip(policies, await asyncio.gather(*(_pressure_run(ckpt, p) for p in policies))))

    runs = asyncio.run(both())
    resident = A_PROMPT + A_OUT - 1
    for p, r in runs.items():
        x, y = r["x"].metrics, r["y"].metrics
        print(f"\n{p}: A round 2 cached {r['a2'].num_cached_tokens} of {len(r['a2'].prompt_token_ids)} prompt tokens; "
              f"Y's first token {y.first_token_time - x.finished_time:+.3f} s after X finished; {r['wall_s']:.1f} s")
        assert r["a1"].num_cached_tokens == 0
        assert [len(r[k].outputs[0].token_ids) for k in ("a1", "x", "y", "a2")] == [A_OUT, X_OUT, Y_OUT, 4]
    c, v = runs["continuum"], runs["vllm"]
    # the pressure was real: with A pinned, Y (10 blocks) waited for X's KV to be freed; vllm evicted A for it
    assert c["y"].metrics.first_token_time > c["x"].metrics.finished_time
    assert v["y"].metrics.first_token_time < v["x"].metrics.finished_time
    # continuum: A's whole resident history is reused
    assert c["a2"].num_cached_tokens == resident
    # vllm: A's KV was evicted and X and Y then took all 16 blocks (6 + 10), A's freed ones included, so not even
    # the prefix cache holds any of A's prompt
    assert v["a2"].num_cached_tokens == 0
