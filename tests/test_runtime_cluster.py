"""The disaggregated runtime end to end: worker processes, KV moving between them, the Coordinator core
routing; greedy outputs equal the offline engine's; a killed worker is noticed and its requests fail clearly."""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("torch")

from tandem.engine.llm import LLM  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.cluster import ClusterConfig, ServingCluster  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(max_model_len=1024, num_kv_blocks=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-cluster")
    make_tiny_model(path, arch="qwen3", size="1m", seed=5)
    return str(path)


async def _round(c, prompt, rid, sid):
    last = None
    async for o in c.generate(prompt, GREEDY, rid, session_id=sid):
        last = o
    return last


def _conversation(run_round, new_tokens):
    """Three rounds; each appends the reply and new tokens, as an agent after a tool call."""
    conv, outs = list(new_tokens[0]), []
    for k in range(3):
        out = run_round(conv, k)
        outs.append(out)
        conv = conv + out.outputs[0].token_ids + new_tokens[k + 1]
    return outs


@pytest.mark.parametrize("policy,p,d,colo", [("dynamo", 1, 1, 0), ("vllm", 0, 0, 1), ("vllm-pd", 1, 1, 0)])
def test_multi_round_session_matches_the_offline_engine(tiny, policy, p, d, colo):
    """Protects each shape of serving a multi-round session live (remote with the history read, co-located, remote
    with the history recomputed on the prefill worker as vLLM's PD does): the same tokens as the offline engine, and
    the cached / transferred KV each path implies."""
    new = [list(range(10, 90)), list(range(200, 230)), list(range(300, 320)), []]

    async def main():
        c = await ServingCluster.start(ClusterConfig(tiny, p, d, colo, policy, engine_args=ENGINE))
        try:
            outs = []
            conv = list(new[0])
            for k in range(3):
                out = await _round(c, conv, f"r{k}", "agent")
                outs.append(out)
                conv = conv + out.outputs[0].token_ids + new[k + 1]
            return outs, c.stats()
        finally:
            await c.shutdown()

    outs, stats = asyncio.run(main())
    llm = LLM(tiny, **ENGINE)
    ref = _conversation(lambda conv, k: llm.generate([conv], GREEDY)[0], new)
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in ref]
    assert all(o.error is None and o.finished for o in outs)
    if policy == "vllm-pd":                                  # the history was recomputed, not reused
        assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
        assert stats.remote_prefills == 3 and stats.local_prefills == 0
        assert len(stats.kv_transfer_seconds) == 3           # 3 incremental write-backs, no history read
        assert stats.prefix_cache_hits == 0
        return
    assert [o.num_cached_tokens for o in outs] == [0, 80 + 6 - 1, 80 + 6 + 30 + 6 - 1]
    if policy == "dynamo":
        assert stats.remote_prefills == 3 and stats.local_prefills == 0
        assert len(stats.kv_transfer_seconds) == 5           # 3 incremental write-backs + 2 history reads
    else:
        assert stats.local_prefills == 3 and stats.remote_prefills == 0


def test_a_killed_decode_worker_is_noticed_and_its_request_fails_with_a_reason(tiny):
    async def main():
        c = await ServingCluster.start(ClusterConfig(tiny, 1, 1, 0, "dynamo", engine_args=ENGINE, max_restarts=0))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
            gen = c.generate(list(range(10, 60)), params, "long", session_id="s")
            first = await gen.__anext__()
            assert first.error is None
            t0 = time.monotonic()
            c.procs.workers[1].kill()                            # the decode worker
            last = first
            async for o in gen:
                last = o
            noticed = time.monotonic() - t0
            return last, noticed, c.is_healthy(), c.stats()
        finally:
            await c.shutdown()

    last, noticed, healthy, stats = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert last.error == "worker lost: decode worker 1 stopped"
    assert noticed < 2.0
    assert not healthy and stats.workers_alive == 1


def test_an_idle_session_expires_and_its_kv_is_freed(tiny):
    async def main():
        c = await ServingCluster.start(ClusterConfig(tiny, 0, 0, 1, "vllm", engine_args=ENGINE, session_ttl_s=0.3))
        try:
            conv = list(range(10, 90))
            first = await _round(c, conv, "a", "s")
            assert "s" in c.shell.coord.live
            await asyncio.sleep(1.0)                                   # > session_ttl_s with the 0.1 s tick
            gone = "s" not in c.shell.coord.live and "s" not in c.shell.conv
            again = await _round(c, conv + first.outputs[0].token_ids + [5, 6], "b", "s")
            return gone, again
        finally:
            await c.shutdown()

    gone, again = asyncio.run(main())
    assert gone
    # the session's KV was released: only the prefix cache's full blocks (5 x 16 of the 80 + 6 - 1 history
    # tokens) are reused, not the 85 resident tokens a live session would have
    assert again.error is None and again.num_cached_tokens == 80


def test_a_worker_busy_in_a_long_step_still_takes_new_requests(tiny):
    """Protects against refusing work while a worker is busy: its steps take 2.6 s (a loaded machine's long prefill
    chunk), longer than the routing view's 2 s liveness limit. A request arriving mid-step used to fail at once with
    "no decode worker left" (the worker published its state only between steps); now the worker publishes every
    20 ms from its event loop, during a step too, and both requests complete."""
    async def main():
        c = await ServingCluster.start(ClusterConfig(tiny, 0, 0, 1, "vllm", engine_args=ENGINE,
                                                     worker_kwargs={0: {"step_sleep_s": 2.6}}))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)      # one step each

            async def one(rid: str, first: int):
                last = None
                async for o in c.generate(list(range(first, first + 20)), params, rid):
                    last = o
                return last
            a = asyncio.create_task(one("a", 10))
            await asyncio.sleep(2.3)                              # mid-step: the last state is 2.3 s old
            b = await one("b", 40)
            return await a, b
        finally:
            await c.shutdown()

    a, b = asyncio.run(main())
    for out in (a, b):
        assert out.error is None and out.finished and len(out.outputs[0].token_ids) == 1


def test_a_request_arriving_mid_step_runs_in_the_next_step(tiny):
    """Protects the early handling of control messages: a request arriving while the worker's model runs a step is
    registered during that step (BeginRound answered, AddRequest queued), so it runs in the very next step. Steps
    take 1.5 s here; "b" arrives 0.5 s into "a"'s first step and finishes with the second step, about 2.5 s after
    it was sent. Before, its BeginRound waited for the first step's end and its AddRequest for the second's, so it
    ran in the third step (about 4 s)."""
    async def main():
        c = await ServingCluster.start(ClusterConfig(tiny, 0, 0, 1, "vllm", engine_args=ENGINE,
                                                     worker_kwargs={0: {"step_sleep_s": 1.5}}))
        try:
            async def one(rid: str, first: int, n: int):
                last = None
                async for o in c.generate(list(range(first, first + 20)), SamplingParams(
                        temperature=0.0, max_tokens=n, ignore_eos=True), rid):
                    last = o
                return last
            a = asyncio.create_task(one("a", 10, 4))
            await asyncio.sleep(0.5)
            t = time.perf_counter()
            b = await one("b", 40, 1)
            took = time.perf_counter() - t
            return await a, b, took
        finally:
            await c.shutdown()

    a, b, took = asyncio.run(main())
    assert a.error is None and len(a.outputs[0].token_ids) == 4
    assert b.error is None and len(b.outputs[0].token_ids) == 1
    assert 1.8 < took < 3.3, f"b took {took:.2f} s: expected one step after the one it arrived in (about 2.5 s)"


def test_a_coordinator_stalled_for_seconds_still_routes_the_next_request(tiny):
    """Protects against a false 503 "no live decode worker" on a loaded host: the coordinator's event loop is
    blocked for 3 s (the workers' states wait unrelayed in its socket, so the newest one it holds is 3 s old), then
    a request arrives before anything is relayed. The workers are alive (their heartbeats say so), so it is served."""
    async def main():
        c = await ServingCluster.start(ClusterConfig(tiny, 0, 0, 1, "vllm", engine_args=ENGINE))
        try:
            time.sleep(3.0)
            last = None
            async for o in c.generate(list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=2,
                                                                          ignore_eos=True), "after-stall"):
                last = o
            return last
        finally:
            await c.shutdown()

    out = asyncio.run(main())
    assert out.error is None and out.finished and len(out.outputs[0].token_ids) == 2
