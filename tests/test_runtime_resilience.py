"""Resilience of the live runtime, each on real worker processes:

- 2.1 a Redis blip (redis-server killed, restarted 0.3 s later) under load: no request hangs, workers stay alive,
  /health and /metrics answer 200 again; the store's writes never raise and the coordinator's reads fall back to
  the last snapshot;
- 2.5 a send that fails (a message that cannot be encoded) fails its request promptly with the reason;
- 2.8 a stream nobody reads holds no growing queue (deltas are coalesced) and is cancelled past its limit;
- 2.7 ended sessions leave nothing behind in the coordinator (many short sessions);
- a lost decode worker beside a live one is routed around at once (new sessions, rebound sessions);
- a replacement's startup phases are computed from marks its Ready carries, distrusted when malformed.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.client import RequestError  # noqa: E402
from tandem.runtime.cluster import ClusterConfig, ServingCluster  # noqa: E402
from tandem.runtime.transport import WorkerUnreachable  # noqa: E402
from tandem.runtime.state_store import (EmbeddedStore, RedisStore, SessionInfo, StateStoreError,  # noqa: E402
                                        WorkerState)
from tandem.runtime.store_view import StoreView  # noqa: E402
from live_server import LiveServer, free_port  # noqa: E402

MODEL = "tiny-resilience"
ENGINE = dict(max_model_len=2048, num_kv_blocks=512)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-resilience")
    make_tiny_model(path, arch="qwen3", size="1m", seed=13)
    return str(path)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


# ---------------------------------------------------------------------------- 2.1: a Redis blip
class _Redis:
    """A redis-server on a fixed port that can be killed and started again on that port."""

    def __init__(self) -> None:
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            pytest.skip("redis-server binary not found on PATH")
        self.redis = pytest.importorskip("redis")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client, deadline = self.redis.Redis(port=self.port, socket_connect_timeout=0.2), time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except self.redis.ConnectionError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.01)
        client.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


def _state(wid: int) -> WorkerState:
    return WorkerState(worker_id=wid, role="decode", tp=1, capacity_tokens=100, published_s=time.time())


def test_redis_store_writes_survive_an_outage_and_reads_fall_back_to_the_last_snapshot():
    """publish/put_session/delete_session never raise while Redis is down (the worker's publish was unhandled and
    killed every worker); after Redis restarts empty, the next publish writes the state back, sessions written
    meanwhile reach Redis, and the StoreView answered from its last snapshot meanwhile."""
    srv = _Redis()
    try:
        store = RedisStore(srv.url)
        view = StoreView(store, cost=None, retry_s=0.0)
        store.publish(_state(1))
        view.refresh()
        assert view.home_workers() == [1]
        srv.kill()
        t0 = time.monotonic()
        for _ in range(50):                                     # never raises, and backs off (fast)
            store.publish(_state(1))
        store.put_session("s", SessionInfo(decode_worker=1, resident_tokens=7))
        assert time.monotonic() - t0 < 2.0 and store.down
        view.refresh()                                          # falls back to the snapshot
        assert view.stale and view.home_workers() == [1] and [s.worker_id for s in view.states()] == [1]
        assert store.get_session("s").resident_tokens == 7      # this process's own copy
        srv.start()                                             # empty: no persistence
        deadline = time.monotonic() + 5
        while store.down or store.get(1) is None:
            assert time.monotonic() < deadline, "the store did not reconnect"
            time.sleep(0.05)
            store.publish(_state(1))
        r = srv.redis.Redis(port=srv.port)
        assert r.get("tandem:default:session:s") is not None     # written back on reconnect
        view.refresh()
        assert not view.stale and view.home_workers() == [1]
        store.delete_session("s")
        assert store.get_session("s") is None and not store._sessions
        store.close()
    finally:
        srv.stop()


def test_a_redis_blip_under_load_keeps_workers_serving_and_no_request_hangs(ckpt):
    """Kill redis-server and restart it 0.3 s later while requests run: both workers stay alive, every request ends
    within its timeout (output or a clear error), /health is 200 again within 10 s and /metrics answers 200."""
    srv = _Redis()
    server = None
    try:
        server = LiveServer(ClusterConfig(ckpt, 1, 1, 0, "ampd", state=srv.url, served_model_name=MODEL,
                                          engine_args=ENGINE))
        pids = [server.pid(0), server.pid(1)]
        results: list = []

        async def one(c: httpx.AsyncClient, i: int) -> dict:
            t0 = time.monotonic()
            body = {"model": MODEL, "prompt": list(range(10 + i, 60 + i)), "max_tokens": 40 + 10 * (i % 5),
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            try:
                r = await c.post("/v1/completions", json=body, headers={"x-session-id": f"blip-{i % 4}-{i}"})
                d = r.json()
                return {"status": r.status_code, "ok": r.status_code == 200 and bool(d["choices"][0]["token_ids"]),
                        "error": d.get("error"), "s": time.monotonic() - t0}
            except httpx.TimeoutException:
                return {"status": "hung", "ok": False, "error": None, "s": time.monotonic() - t0}

        async def load() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
                async def wave(k: int) -> None:
                    results.extend(await asyncio.gather(*(one(c, 8 * k + i) for i in range(8))))
                await asyncio.gather(*(wave(k) for k in range(6)))

        def run_load() -> None:
            asyncio.run(load())

        # a few requests before the blip: all served
        before: list = []
        asyncio.run(_warm(server, before, one))
        assert all(r["ok"] for r in before), before
        t = threading.Thread(target=run_load)
        t.start()
        time.sleep(0.2)                                          # under load
        srv.kill()
        time.sleep(0.3)
        srv.start()
        t.join(120)
        assert not t.is_alive(), "the load did not finish: a request hangs"
        assert len(results) == 48
        hung = [r for r in results if r["status"] == "hung"]
        assert not hung, hung
        for r in results:                                         # output, or a clear error
            assert r["ok"] or (r["status"] != 200 and r["error"] and r["error"].get("message")), r
        for pid in pids:                                         # both workers alive
            os.kill(pid, 0)
        assert server.call(lambda: len(server.cluster._lost)) == 0
        took = server.wait_for("/health 200", lambda: server.health() == 200, timeout_s=10)
        m = server.metrics()                                     # asserts 200
        assert m["tandem:workers_alive"] == 2
        after: list = []
        asyncio.run(_warm(server, after, one))
        assert all(r["ok"] for r in after), after
        ok = sum(r["ok"] for r in results)
        print(f"\nredis blip: {ok}/48 served during it, the rest a clear error; /health 200 after {took:.2f} s")
    finally:
        if server is not None:
            server.stop()
        srv.stop()


async def _warm(server, out: list, one) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
        out.extend(await asyncio.gather(*(one(c, 100 + i) for i in range(3))))


# ---------------------------------------------------------------------------- 2.5: a failing send
def test_a_message_that_cannot_be_sent_fails_its_request_promptly(ckpt):
    """A seed out of msgpack's range (set past SamplingParams' check) makes encoding AddRequest raise OverflowError
    in the send task; the request used to hang forever (and block shutdown). Now it ends with the reason, and the
    cluster serves the next request."""
    async def main():
        c = await ServingCluster.start(ClusterConfig(ckpt, 0, 0, 1, "vllm", engine_args=ENGINE))
        try:
            bad = _greedy(8)
            bad.seed = 2 ** 70                                   # not encodable: OverflowError when it is sent
            t0 = time.monotonic()
            last = None

            async def drain():
                nonlocal last
                async for o in c.generate(list(range(10, 40)), bad, "bad"):
                    last = o
            await asyncio.wait_for(drain(), timeout=5)
            took = time.monotonic() - t0
            good = None
            async for o in c.generate(list(range(10, 40)), _greedy(4), "good"):
                good = o
            await asyncio.sleep(0.1)                             # the last sends complete
            left = (len(c.shell.reqs), len(c.shell.session_req), len(c.shell.by_task))
            return last, took, good, left
        finally:
            t1 = time.monotonic()
            await c.shutdown()
            assert time.monotonic() - t1 < 30

    last, took, good, left = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert "could not send AddRequest" in last.error and "OverflowError" in last.error
    assert took < 2.0
    assert good.error is None and len(good.outputs[0].token_ids) == 4
    assert left == (0, 0, 0)


def test_a_send_to_a_worker_that_is_gone_fails_as_worker_lost(ckpt):
    """A worker that died between the core's routing and the send (the hub has no connection to it: the Ray test
    hit this when a decode actor was killed with rounds starting) fails the round with a 503 "worker lost", as a
    death noticed by the supervisor does, not a 500 "internal error"; the next request is served."""
    async def main():
        c = await ServingCluster.start(ClusterConfig(ckpt, 0, 0, 1, "vllm", engine_args=ENGINE))
        try:
            real = c.hub.post

            def gone(worker, msg):
                raise WorkerUnreachable(f"worker {worker} is not connected")
            c.hub.post = gone
            with pytest.raises(RequestError) as e:
                async for _ in c.generate(list(range(10, 40)), _greedy(4), "lost", session_id="s-lost"):
                    pass
            c.hub.post = real
            good = None
            async for o in c.generate(list(range(10, 40)), _greedy(4), "good"):
                good = o
            return e.value, good
        finally:
            await c.shutdown()

    err, good = asyncio.run(main())
    assert err.status == 503 and str(err).startswith("worker lost: could not send BeginRound to worker 0")
    assert good.error is None and len(good.outputs[0].token_ids) == 4


# ---------------------------------------------------------------------------- 2.8: an unread stream
def test_an_unread_stream_holds_no_growing_queue_and_is_cancelled_past_its_limit(ckpt):
    """Outputs a consumer has not read are coalesced into the request's one cumulative output (no per-output
    copies: the old queue copied the whole token list per output, quadratic); a consumer more than
    max_unread_outputs behind is cancelled with a reason, which it reads next."""
    async def main():
        c = await ServingCluster.start(ClusterConfig(ckpt, 0, 0, 1, "vllm", engine_args=ENGINE,
                                                     max_unread_outputs=64))
        try:
            # (a) under the limit: nothing queues; the next read is the whole cumulative output at once
            gen = c.generate(list(range(10, 40)), _greedy(40), "slow")
            first = await gen.__anext__()
            req = c.shell.reqs.get("slow") or c.shell.session_req.get("req-slow")
            peak = 0
            while not req.done:
                peak = max(peak, req.unread)
                await asyncio.sleep(0.005)
            nxt = await gen.__anext__()                          # one read: everything, finished
            await gen.aclose()
            # (b) past the limit: cancelled with a reason
            gen2 = c.generate(list(range(10, 40)), _greedy(1500), "stalled")
            await gen2.__anext__()
            req2 = c.shell.reqs["stalled"]
            peak2, t0 = 0, time.monotonic()
            while not req2.done and time.monotonic() - t0 < 60:
                peak2 = max(peak2, req2.unread)
                await asyncio.sleep(0.005)
            got = await gen2.__anext__()
            await gen2.aclose()
            await asyncio.sleep(0.3)
            return first, nxt, peak, got, peak2, c.stats()
        finally:
            await c.shutdown()

    first, nxt, peak, got, peak2, stats = asyncio.run(main())
    assert not first.finished
    assert nxt.finished and nxt.error is None and len(nxt.outputs[0].token_ids) == 40
    assert peak <= 40
    assert got.finished and got.outputs[0].finish_reason == "abort"
    assert got.error.startswith("cancelled: the client read none of the last 64 outputs")
    assert peak2 <= 65 and len(got.outputs[0].token_ids) < 1500
    assert stats.num_requests_running == 0


# ---------------------------------------------------------------------------- 2.7: many short sessions
def test_many_short_sessions_leave_nothing_behind(ckpt):
    """Named sessions that expire, one-round requests, and aborted sessions: once they ended, the shell's
    conversations, requests, tasks, begun rounds, the core's live sessions and the store's session bindings are
    all empty, and the core's records stay bounded (local prefills used to leave their task in by_task)."""
    async def main():
        c = await ServingCluster.start(ClusterConfig(ckpt, 0, 0, 1, "vllm", engine_args=ENGINE, session_ttl_s=0.3))
        try:
            sh = c.shell

            async def rnd(prompt, rid, sid=None, n=2):
                last = None
                async for o in c.generate(prompt, _greedy(n), rid, session_id=sid):
                    last = o
                return last

            for k in range(40):
                p = list(range(10 + k % 7, 30 + k % 7))
                a = await rnd(p, f"a{k}", f"s{k}")                          # a named session: 2 rounds
                await rnd(p + a.outputs[0].token_ids + [3, 4], f"b{k}", f"s{k}")
                await rnd(p, f"c{k}")                                       # no session
                gen = c.generate(p, _greedy(200), f"d{k}", session_id=f"x{k}")
                await gen.__anext__()
                await gen.aclose()                                          # the client went away
            await asyncio.sleep(1.0)                                        # > session_ttl_s
            store = sh.store
            return dict(conv=len(sh.conv), reqs=len(sh.reqs), session_req=len(sh.session_req),
                        by_task=len(sh.by_task), begun=len(sh._begun), live=len(sh.coord.live),
                        store_sessions=len(store._sessions) if isinstance(store, EmbeddedStore) else 0,
                        records=len(sh.coord.records), transfers=len(sh.coord.transfers))
        finally:
            await c.shutdown()

    left = asyncio.run(main())
    records = left.pop("records")
    assert left == dict(conv=0, reqs=0, session_req=0, by_task=0, begun=0, live=0, store_sessions=0, transfers=0)
    assert records <= 1000 + 120                          # trimmed past 2 x live + 1000 (check_timeouts)


def test_store_view_drop_removes_a_worker_without_a_store_round_trip():
    """cluster._on_dead used to call store.remove and view.refresh before failing the requests: a store error there
    left them hanging. view.drop takes the dead worker out of the routing sets with no store I/O."""
    store = EmbeddedStore()
    for w in (1, 2):
        store.publish(_state(w))
    view = StoreView(store, cost=None)
    assert view.home_workers() == [1, 2]

    class Broken:
        def all(self):
            raise StateStoreError("state store: lost Redis")
    view.store = Broken()
    view.drop(2)
    assert view.home_workers() == [1]
    view.refresh()                                               # the store is down: the snapshot, minus the dead
    assert view.home_workers() == [1] and view.stale


# ---------------------------------------------------------------------------- a decode worker lost beside another
def test_a_lost_decode_worker_is_routed_around_at_once_while_another_lives(ckpt):
    """Protects routing around a dead home: 1P+2D (no restarts), one decode worker SIGKILLed → the server stays
    healthy, new sessions bind to the live decode worker (before any replacement could exist), and sessions bound
    to the dead one between rounds are bound again there and their next round is served; none is lost."""
    async def main():
        c = await ServingCluster.start(ClusterConfig(ckpt, 1, 2, 0, "ampd", engine_args=ENGINE, max_restarts=0))
        try:
            async def rnd(prompt, rid, sid):
                last = None
                async for o in c.generate(prompt, _greedy(3), rid, session_id=sid):
                    last = o
                return last

            firsts = {}
            for k in range(6):
                firsts[f"s{k}"] = (p := list(range(20 + 3 * k, 60 + 3 * k)), await rnd(p, f"r{k}", f"s{k}"))
            homes = {sid: c.shell.coord.live[sid].worker for sid in firsts}
            dead = 2 if list(homes.values()).count(2) else 1
            live = 3 - dead
            os.kill(c.procs.workers[dead].pid, signal.SIGKILL)
            t0 = time.monotonic()
            while c.stats().workers_alive == 3:
                assert time.monotonic() - t0 < 5, "the death was not noticed"
                await asyncio.sleep(0.01)
            noticed, healthy = time.monotonic() - t0, c.is_healthy()
            fresh = [await rnd(list(range(100 + k, 140 + k)), f"n{k}", f"n{k}") for k in range(4)]
            fresh_homes = [c.shell.coord.live[f"n{k}"].worker for k in range(4)]
            again = {sid: await rnd(p + out.outputs[0].token_ids + [7, 8], f"{sid}-2", sid)
                     for sid, (p, out) in firsts.items()}
            again_homes = {sid: c.shell.coord.live[sid].worker for sid in firsts}
            return homes, dead, live, noticed, healthy, fresh, fresh_homes, again, again_homes
        finally:
            await c.shutdown()

    homes, dead, live, noticed, healthy, fresh, fresh_homes, again, again_homes = asyncio.run(main())
    assert dead in homes.values() and noticed < 1.0 and healthy
    assert fresh_homes == [live] * 4
    assert all(o.finished and o.error is None and len(o.outputs[0].token_ids) == 3 for o in fresh)
    assert all(o.finished and o.error is None and len(o.outputs[0].token_ids) == 3 for o in again.values())
    assert set(again_homes.values()) == {live}
    assert sum(1 for w in homes.values() if w == dead) >= 1


# ---------------------------------------------------------------------------- a replacement's startup phases
def test_restart_phases_break_a_replacement_down_from_its_marks_and_distrust_bad_ones():
    """Protects the recovery breakdown: each phase runs from the previous mark (a missing mark folds into the next
    phase), and marks from a worker's Ready are kept only when they are finite numbers under known names."""
    from tandem.runtime.cluster import restart_phases, startup_marks_of
    marks = {"begun": 10.0, "started": 10.1, "imported": 10.15, "model_loaded": 10.65, "ready": 10.85,
             "ready_received": 10.86, "routable": 10.9}
    got = restart_phases(9.9, marks)
    assert list(got) == ["backoff", "fork", "imports", "model load", "setup", "handshake", "registration"]
    assert got == pytest.approx({"backoff": 0.1, "fork": 0.1, "imports": 0.05, "model load": 0.5, "setup": 0.2,
                                 "handshake": 0.01, "registration": 0.04})
    del marks["imported"]
    assert restart_phases(9.9, marks)["model load"] == pytest.approx(0.55) and "imports" not in restart_phases(9.9, marks)
    hostile = {"startup": {"started": "1", "imported": float("nan"), "model_loaded": True, "ready": 5.0, "x": 1.0}}
    assert startup_marks_of(hostile) == {"ready": 5.0}
    assert startup_marks_of({"startup": [1, 2]}) == {} and startup_marks_of({}) == {}
