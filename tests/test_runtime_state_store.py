"""The runtime state store (embedded and a real redis-server) and the coordinator's StoreView over it."""
from __future__ import annotations

import random
import socket
import time
import uuid

import pytest

from tandem.core.state import InProcessState
from tandem.core.types import COLOCATED, DECODE, PREFILL, PrefillTask, StepResult
from tandem.core.worker import WorkerConfig, WorkerCore
from tandem.perf.ampd_cost import AMPDCostModel
from tandem.policy.routing import AdaptiveRouter
from tandem.runtime.state_store import (
    DEFAULT_TTL_S, EmbeddedStore, RedisStore, SessionInfo, StateStoreError, WorkerState, open_store,
)
from tandem.runtime.store_view import StoreView
from redis_helper import redis_server  # noqa: E402

T = 100.0                     # the cores' clock when they publish


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(params=["embedded", "redis"])
def make_store(request):
    """Build stores of the parametrised kind; Redis ones get a cluster name of their own."""
    made = []

    def make(ttl_s: float | None = None):
        if request.param == "embedded":
            s = EmbeddedStore(ttl_s=ttl_s)
        else:
            url = request.getfixturevalue("redis_url")
            s = RedisStore(url, cluster=f"t{uuid.uuid4().hex[:8]}", **({"ttl_s": ttl_s} if ttl_s else {}))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


class Clock:
    """An injected wall clock."""

    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------- store round trips
def _state(wid: int, **kw) -> WorkerState:
    base = dict(worker_id=wid, role=PREFILL, tp=2, node=1, control_addr=f"tcp://10.0.0.{wid}:5000",
                kv_addr=f"tcp://10.0.0.{wid}:5001", ttft_mean_s=0.123456789, itl_mean_s=0.0312,
                window_s=10.0, queued_prefill_s=1.5e-3, capacity_tokens=123_456, free_tokens=100_000,
                kv_usage=0.19, num_running=3, num_waiting=7, published_s=1_700_000_000.123456, alive=True)
    base.update(kw)
    return WorkerState(**base)


def test_publish_get_all_remove_round_trip_exact_values(make_store):
    store = make_store()
    assert store.get(0) is None and store.all() == []
    a, b, c = _state(3), _state(0, role=DECODE, tp=1, node=0), _state(12, role=COLOCATED, alive=False)
    for s in (a, b, c):
        store.publish(s)
    assert store.get(3) == a and store.get(0) == b and store.get(12) == c
    assert store.all() == [b, a, c]                              # ordered by worker id
    a2 = _state(3, queued_prefill_s=9.75, published_s=1_700_000_001.5)
    store.publish(a2)                                            # a new publish replaces the old one
    assert store.get(3) == a2 and store.all() == [b, a2, c]
    store.remove(0)
    store.remove(77)                                             # removing an unknown worker is fine
    assert store.get(0) is None and store.all() == [a2, c]


def test_worker_entries_expire_after_their_ttl(make_store):
    store = make_store(ttl_s=0.6)
    store.publish(_state(1))
    store.publish(_state(2))
    time.sleep(0.35)
    store.publish(_state(2))                                     # worker 2 heartbeats; worker 1 died
    time.sleep(0.35)                                             # 1 expired at 0.6 s; 2 lives until >= 0.95 s
    assert store.get(1) is None and [s.worker_id for s in store.all()] == [2]
    time.sleep(0.4)
    assert store.all() == [] and store.get(2) is None


def test_sessions_put_get_delete(make_store):
    store = make_store()
    assert store.get_session("s1") is None
    info = SessionInfo(decode_worker=4, resident_tokens=5120, updated_s=12.5)
    store.put_session("s1", info)
    store.put_session("gaia-17:x", SessionInfo(decode_worker=1))
    assert store.get_session("s1") == info
    assert store.get_session("gaia-17:x") == SessionInfo(decode_worker=1, resident_tokens=0, updated_s=0.0)
    store.put_session("s1", SessionInfo(decode_worker=4, resident_tokens=6000))
    assert store.get_session("s1").resident_tokens == 6000
    store.delete_session("s1")
    store.delete_session("never")
    assert store.get_session("s1") is None and store.get_session("gaia-17:x") is not None


def test_redis_layout_is_prefixed_per_cluster(redis_url):
    import redis
    a, b = RedisStore(redis_url, cluster="alpha"), RedisStore(redis_url, cluster="beta")
    try:
        a.publish(_state(1))
        a.put_session("s", SessionInfo(decode_worker=1))
        assert b.all() == [] and b.get_session("s") is None      # deployments do not see each other
        r = redis.Redis.from_url(redis_url)
        assert r.exists("tandem:alpha:worker:1", "tandem:alpha:session:s") == 2
        assert 0 < r.pttl("tandem:alpha:worker:1") <= 5000       # worker keys carry the TTL
        assert r.pttl("tandem:alpha:session:s") == -1            # sessions do not expire by default
        r.close()
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("url", ["redis://localhost", "redis://h:0", "redis://h:65536", "rediss://h:6379",
                                 "redis://h:6379/x", "redis://user:pw@h:6379", "redis://h:6379/0?x=1", "redis:/h:1"])
def test_malformed_redis_url_is_a_one_line_error(url):
    with pytest.raises(StateStoreError) as e:
        open_store(url) if url.startswith("redis://") else RedisStore(url)
    msg = str(e.value)
    assert "\n" not in msg and "redis://HOST:PORT[/DB]" in msg and repr(url) in msg


@pytest.mark.parametrize("spec", ["", "redis", "memory", "Embedded", "http://h:1"])
def test_unknown_store_spec_names_the_valid_forms(spec):
    with pytest.raises(StateStoreError, match=r"expected 'embedded' or redis://HOST:PORT\[/DB\]$"):
        open_store(spec)


def test_open_store_builds_both_kinds(redis_url):
    assert isinstance(open_store("embedded"), EmbeddedStore)
    s = open_store(redis_url + "/3", cluster="x")
    assert isinstance(s, RedisStore)
    s.close()


def test_unreachable_redis_is_a_prompt_one_line_error():
    port = _free_port()                                          # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(StateStoreError) as e:
        RedisStore(f"redis://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 3.0
    msg = str(e.value)
    assert "\n" not in msg and f"cannot reach Redis at 127.0.0.1:{port}/0" in msg


def test_redis_going_away_is_a_state_store_error():
    with redis_server() as url:
        store = RedisStore(url)
        store.publish(_state(1))
    with pytest.raises(StateStoreError) as e:                    # the server has stopped
        store.all()
    assert "\n" not in str(e.value) and "Redis at 127.0.0.1" in str(e.value)
    store.close()


# ---------------------------------------------------------------------------- StoreView vs InProcessState
@pytest.fixture(scope="module")
def cost() -> AMPDCostModel:
    return AMPDCostModel.from_roofline("qwen2.5-7b", "h20", (1, 2))


NODES = [0, 1, 0, 1]


def _cluster(cost: AMPDCostModel) -> list[WorkerCore]:
    """Prefill tp1 (node 0), prefill tp2 (node 1), decode tp2 (node 0), co-located tp1 (node 1), all loaded."""
    roles = [(PREFILL, 1), (PREFILL, 2), (DECODE, 2), (COLOCATED, 1)]
    cores = []
    for wid, (role, tp) in enumerate(roles):
        cfg = WorkerConfig(role=role, tp=tp, num_blocks=64 * (wid + 1), block_size=16)
        cores.append(WorkerCore(wid, cfg, t_pre=lambda h, n, _tp=tp: cost.t_pre(h, n, _tp)))
    p0, p1, d, c = cores
    p0.ttft.add(85.0, 5.0)                                       # out of the window at T
    p0.ttft.add(95.0, 0.8)
    p0.ttft.add(99.0, 0.4)
    for i in range(2):
        p0.submit(PrefillTask(f"q{i}", 0, 0, 700, 99.0, decode_worker=2, local=False), 99.0)
    p1.ttft.add(99.5, 0.3)
    p1.submit(PrefillTask("r", 1, 200, 900, 99.0, decode_worker=2, local=False), 99.0)
    p1.schedule(99.2)                                            # admitted: counted as active work
    d.attach("s1")
    d.begin_round("s1")
    d.submit(PrefillTask("s1", 0, 0, 300, 90.0, output_tokens=4, decode_worker=2), 90.0)
    now = 96.0
    while (plan := d.schedule(now)) is not None:
        d.on_step_done(plan, StepResult(0.04), now + 0.04)
        now += 0.05
    d.drain()
    d.attach("s2")
    d.begin_round("s2")
    d.submit(PrefillTask("s2", 0, 0, 1200, 99.9, decode_worker=2), 99.9)
    c.itl.add(99.0, 0.09, 3)
    return cores


def _publish_all(store, cores, clock: Clock) -> None:
    for core in cores:
        store.publish(WorkerState.from_core(core, T, node=NODES[core.id], published_s=clock()))
    d = cores[2]
    store.put_session("s1", SessionInfo(decode_worker=2, resident_tokens=d.seqs["s1"].num_tokens))


def test_from_core_fills_every_field(cost):
    cores = _cluster(cost)
    d = cores[2]
    s = WorkerState.from_core(d, T, node=0, control_addr="tcp://a:1", kv_addr="tcp://a:2", published_s=5.0)
    assert (s.worker_id, s.role, s.tp, s.node, s.control_addr, s.kv_addr) == (2, DECODE, 2, 0, "tcp://a:1", "tcp://a:2")
    assert s.ttft_mean_s == d.ttft.mean(T) > 0 and s.itl_mean_s == d.itl.mean(T) > 0
    assert s.window_s == 10.0 and s.queued_prefill_s == d.pending_prefill_s() > 0
    assert s.capacity_tokens == 192 * 16 and s.kv_usage == d.kv_usage > 0
    assert s.free_tokens == d.blocks.num_free * 16 == s.capacity_tokens - round(s.kv_usage * s.capacity_tokens)
    assert (s.num_running, s.num_waiting, s.published_s, s.alive) == (0, 1, 5.0, True)
    p1 = WorkerState.from_core(cores[1], T)
    assert p1.num_running == 1 and p1.num_waiting == 0 and abs(p1.published_s - time.time()) < 5


def test_store_view_answers_exactly_what_in_process_state_does(make_store, cost):
    cores, clock = _cluster(cost), Clock()
    store = make_store()
    _publish_all(store, cores, clock)
    clock.t += 0.5
    view = StoreView(store, cost, clock=clock)
    ref = InProcessState(cores, cost, NODES)
    assert list(view.prefill_workers()) == list(ref.prefill_workers()) == [0, 1]
    assert list(view.home_workers()) == list(ref.home_workers()) == [2, 3]
    for w in range(4):
        assert view.windowed_ttft(w, T) == ref.windowed_ttft(w, T)
        assert view.windowed_itl(w, T) == ref.windowed_itl(w, T)
        assert view.queued_prefill_s(w) == ref.queued_prefill_s(w)
        assert view.capacity(w) == ref.capacity(w)
        for h, n in ((0, 1), (300, 800), (4000, 128)):
            assert view.t_pre(w, h, n) == ref.t_pre(w, h, n)
        for tokens in (1, ref.capacity(w), ref.capacity(w) + 1):
            assert view.can_hold(w, tokens) == ref.can_hold(w, tokens)
        for dst in range(4):
            assert view.t_kv(5000, w, dst) == ref.t_kv(5000, w, dst)
    assert [ref.windowed_ttft(w, T) > 0 for w in range(4)] == [True, True, True, False]
    assert ref.queued_prefill_s(0) > 0 and ref.queued_prefill_s(1) > 0
    assert view.begin_round(2, "s1") == ref.begin_round(2, "s1") == 303
    assert view.begin_round(3, "new") == ref.begin_round(3, "new") == 0
    assert store.get_session("new") == SessionInfo(decode_worker=3, resident_tokens=0, updated_s=clock())


def test_begin_round_on_another_worker_rebinds_with_nothing_resident(make_store, cost):
    store, clock = make_store(), Clock()
    view = StoreView(store, cost, clock=clock)
    store.put_session("s", SessionInfo(decode_worker=2, resident_tokens=900))
    assert view.begin_round(2, "s") == 900
    assert view.begin_round(3, "s") == 0                         # its home failed: rebound to 3
    assert store.get_session("s").decode_worker == 3


def test_adaptive_router_decides_the_same_on_store_view_as_in_process(make_store, cost):
    cores, clock = _cluster(cost), Clock()
    store = make_store()
    _publish_all(store, cores, clock)
    view, ref = StoreView(store, cost, clock=clock), InProcessState(cores, cost, NODES)
    decisions = set()
    for slack in ("predicted", "window"):
        for ttft_slo in (0.05, 0.3, 0.7, 2.0):
            for itl_slo in (0.01, 1.0):
                for l_incr in (64, 2000):
                    got = []
                    for v in (view, ref):
                        task = PrefillTask("s1", 1, 303, l_incr, 99.8, ttft_slo_s=ttft_slo, itl_slo_s=itl_slo,
                                           decode_worker=2)
                        got.append(AdaptiveRouter(random.Random(7), slack=slack).route(task, v, T))
                    assert got[0] == got[1], (slack, ttft_slo, itl_slo, l_incr)
                    decisions.add(got[0])
    assert decisions == {0, 1, 2}                                # the situation exercises every outcome


# ---------------------------------------------------------------------------- liveness, staleness, cache
def test_dead_or_silent_workers_leave_the_routing_sets(make_store, cost):
    store, clock = make_store(), Clock()
    store.publish(_state(0, role=PREFILL, published_s=clock()))
    store.publish(_state(1, role=PREFILL, published_s=clock() - 3.0))     # silent for 3 s > 2 s
    store.publish(_state(2, role=PREFILL, published_s=clock(), alive=False))  # said goodbye
    store.publish(_state(3, role=DECODE, published_s=clock() - 1.0))
    store.publish(_state(4, role=COLOCATED, published_s=clock() - 2.5))
    view = StoreView(store, cost, liveness_s=2.0, clock=clock)
    assert list(view.prefill_workers()) == [0] and list(view.home_workers()) == [3]
    assert view.queued_prefill_s(1) == 1.5e-3                    # a dead worker's last state is still readable
    clock.t += 1.5                                               # worker 3 is now 2.5 s silent
    assert list(view.prefill_workers()) == [0] and list(view.home_workers()) == []
    clock.t += 0.6
    assert list(view.prefill_workers()) == []
    with pytest.raises(StateStoreError, match="worker 9 has no state"):
        view.t_pre(9, 0, 10)


def test_means_older_than_their_window_count_as_zero(make_store, cost):
    store, clock = make_store(), Clock()
    store.publish(_state(0, published_s=clock() - 9.0, window_s=10.0))
    store.publish(_state(1, published_s=clock() - 11.0, window_s=10.0))
    view = StoreView(store, cost, liveness_s=60.0, clock=clock)
    assert view.windowed_ttft(0, T) == 0.123456789 and view.windowed_itl(0, T) == 0.0312
    assert view.windowed_ttft(1, T) == 0.0 and view.windowed_itl(1, T) == 0.0
    assert view.queued_prefill_s(1) == 1.5e-3                    # queue estimates are not windowed
    assert list(view.prefill_workers()) == [0, 1]


def test_reads_are_cached_for_max_age(make_store, cost):
    store, clock = make_store(), Clock()
    calls = []
    real_all = store.all
    store.all = lambda: calls.append(1) or real_all()
    store.publish(_state(0, published_s=clock()))
    view = StoreView(store, cost, max_age_s=0.010, clock=clock)
    assert list(view.prefill_workers()) == [0]
    store.publish(_state(1, published_s=clock()))
    for w in (0, 0):
        view.queued_prefill_s(w)
        view.t_pre(w, 10, 10)
    assert list(view.prefill_workers()) == [0] and len(calls) == 1   # one read per routing call
    clock.t += 0.011
    assert list(view.prefill_workers()) == [0, 1] and len(calls) == 2
    clock.t -= 5.0                                               # a wall clock stepped back: re-read
    view.prefill_workers()
    assert len(calls) == 3
    view.refresh()
    assert len(calls) == 4


def test_coordinator_binds_and_routes_on_a_store_view(make_store, cost):
    from tandem.core.actions import Submit
    from tandem.core.coordinator import Coordinator
    from tandem.workload.session import SLO, Round, Session

    cores, clock = _cluster(cost), Clock()
    store = make_store()
    _publish_all(store, cores, clock)
    view = StoreView(store, cost, clock=clock)
    coord = Coordinator(view, AdaptiveRouter(random.Random(0)))
    assert coord.capacity == {2: cores[2].capacity_tokens, 3: cores[3].capacity_tokens}
    session = Session("new", T, [Round(500, 20, 1.0), Round(100, 20)], slo=SLO(2.0, 0.1))
    (act,) = coord.on_session_arrival(session, T)
    assert isinstance(act, Submit) and act.task.decode_worker in (2, 3) and act.worker in (0, 1, 2, 3)
    assert store.get_session("new") == SessionInfo(decode_worker=act.task.decode_worker, updated_s=clock())


def test_a_worker_missing_from_an_emptied_store_stays_routable_while_its_last_state_is_fresh(make_store, cost):
    """Protects serving across a Redis restart: the store comes back empty before the workers publish again; a
    worker whose last state is 0.5 s old stays in the routing sets (a new session found no home and got 503 on a
    healthy cluster), and leaves once that state is liveness_s (2 s) old if it never publishes again."""
    store, clock = make_store(), Clock()
    store.publish(_state(0, role=PREFILL, published_s=clock()))
    store.publish(_state(3, role=DECODE, published_s=clock()))
    view = StoreView(store, cost, liveness_s=2.0, clock=clock)
    assert (list(view.prefill_workers()), list(view.home_workers())) == ([0], [3])
    store.remove(0)
    store.remove(3)                                              # Redis restarted empty
    clock.t += 0.5
    view.refresh()
    assert (list(view.prefill_workers()), list(view.home_workers())) == ([0], [3])
    clock.t += 1.6                                               # 2.1 s without a publish
    view.refresh()
    assert (list(view.prefill_workers()), list(view.home_workers())) == ([], [])


def test_states_a_busy_coordinator_relays_late_keep_their_workers_routable(make_store, cost):
    """Protects against refusing requests ("no live decode worker", 503) because the coordinator's own loop was too
    busy to relay the workers' states for a few seconds: by default a state proves its worker alive for the store's
    key TTL, and only a worker silent longer than that (or dropped by the transport) leaves the routing sets."""
    store, clock = make_store(), Clock()
    store.publish(_state(0, role=PREFILL, published_s=clock()))
    store.publish(_state(1, role=DECODE, published_s=clock()))
    view = StoreView(store, cost, clock=clock)
    assert view.liveness_s == DEFAULT_TTL_S == 5.0
    clock.t += 4.9                                               # no state relayed for 4.9 s: still routable
    assert list(view.prefill_workers()) == [0] and list(view.home_workers()) == [1]
    clock.t += 0.2                                               # 5.1 s: gone
    assert list(view.prefill_workers()) == [] and list(view.home_workers()) == []
    view.revive(1)
    store.publish(_state(1, role=DECODE, published_s=clock()))
    view.drop(1)                                                 # the transport's word is final at once
    assert list(view.home_workers()) == []
