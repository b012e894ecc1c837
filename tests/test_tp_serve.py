"""The live server with prefill and decode workers at different tensor-parallel degrees (tiny Qwen3, 2 KV heads, on
CPU): multi-round sessions over HTTP, every prefill remote (dynamo), so each later round's history KV goes from the
decode worker to the prefill worker and the new KV back, regrouped between the degrees; outputs equal the tp=1
offline engine's and the decode worker reuses the transferred KV (cached tokens). A killed rank of a tp=2 decode
group takes the whole group down: its requests end (with their output or a clear error), the group is replaced as
one worker, /health is 200 again, and no process of the old group is left. `tandem serve --deploy` maps to these
deployments."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal

import httpx
import pytest

psutil = pytest.importorskip("psutil")
torch = pytest.importorskip("torch")

from tandem.cli.common import CLIError  # noqa: E402
from tandem.cli.main import main  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.runtime.cluster import ClusterConfig  # noqa: E402

from live_server import LiveServer  # noqa: E402
import tp_helpers  # noqa: E402
from tp_helpers import needs_two_cores  # noqa: E402

MODEL, ENGINE = tp_helpers.SERVED_MODEL, tp_helpers.SERVE_ENGINE
tiny, offline = tp_helpers.tiny, tp_helpers.offline   # the shared module fixtures
SESSIONS, ROUNDS, NEW, OUT = 3, 3, (29, 13, 7), 6


def _start(tiny: str, role_tp: dict[str, int], **kw) -> LiveServer:
    return LiveServer(ClusterConfig(tiny, 1, 1, 0, "dynamo", served_model_name=MODEL, engine_args=ENGINE,
                                    role_tp=role_tp, **kw))


async def _complete(c: httpx.AsyncClient, prompt: list[int], max_tokens: int, session: str | None) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = await c.post("/v1/completions", json=body, headers={"x-session-id": session} if session else {})
    if r.status_code != 200:
        return {"status": r.status_code, "error": r.json()["error"]["message"], "token_ids": []}
    d = r.json()
    return {"status": 200, "token_ids": d["choices"][0]["token_ids"], "error": None,
            "cached": d["usage"]["prompt_tokens_details"]["cached_tokens"]}


def _sessions(url: str, vocab: int) -> list[list[tuple[list[int], dict]]]:
    """SESSIONS concurrent sessions of ROUNDS rounds each: (prompt, result) per round."""
    g = torch.Generator().manual_seed(11)
    news = [[torch.randint(3, vocab - 8, (n,), generator=g).tolist() for n in NEW] for _ in range(SESSIONS)]

    async def one(c: httpx.AsyncClient, i: int) -> list[tuple[list[int], dict]]:
        conv, out = [], []
        for k in range(ROUNDS):
            conv = conv + news[i][k]
            res = await _complete(c, conv, OUT, f"s{i}")
            assert res["status"] == 200, res
            out.append((list(conv), res))
            conv = conv + res["token_ids"]
        return out

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(SESSIONS)))
    return asyncio.run(go())


@needs_two_cores
@pytest.mark.parametrize("role_tp", [{"prefill": 2}, {"decode": 2}], ids=["P-tp2_D-tp1", "P-tp1_D-tp2"])
def test_sessions_across_degrees_equal_the_one_rank_engine_and_reuse_transferred_kv(tiny, offline, role_tp):
    """Protects KV between workers of different degrees in the live server: every round prefilled remotely (history
    read from the decode worker, new KV sent back, each regrouped), each later round's cached tokens are the
    session's previous prompt + output - 1 (the decode worker kept and reused the KV it was sent), and every round's
    greedy tokens equal the tp=1 offline engine's on the whole conversation."""
    srv = _start(tiny, role_tp)
    try:
        wid = 0 if "prefill" in role_tp else 1
        assert len(srv.cluster.rank_pids()[wid]) == 1 and srv.cluster.rank_pids()[1 - wid] == []
        done = _sessions(srv.url, offline.engine.model_config.vocab_size)
        m = srv.metrics()
    finally:
        srv.stop()
    assert (m["tandem:remote_prefills_total"], m["tandem:local_prefills_total"]) == (SESSIONS * ROUNDS, 0), done
    for rounds in done:
        for (p0, r0), (_, r1) in zip(rounds, rounds[1:]):
            assert r1["cached"] == len(p0) + len(r0["token_ids"]) - 1
    prompts = [p for rounds in done for p, _ in rounds]
    refs = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True))
    assert [r["token_ids"] for rounds in done for _, r in rounds] == [o.outputs[0].token_ids for o in refs]


def _group(pid: int) -> set[int]:
    """A worker process and every process under it (its ranks, their fork server)."""
    try:
        return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@needs_two_cores
def test_a_killed_rank_takes_its_decode_group_down_and_the_group_is_replaced(tiny, offline):
    """Protects supervision of a tensor-parallel worker: SIGKILL of rank 1 of the tp=2 decode group while requests
    decode ends each request with its full output or the error `worker lost: decode worker 1 stopped` (none hangs),
    the worker exits with its group, the supervisor starts a new group (new driver, new rank), /health is 200 again,
    no process of the old group remains, and the new group serves a request with the tp=1 engine's tokens."""
    srv = _start(tiny, {"decode": 2}, worker_timeout_s=2.0)
    try:
        driver = srv.pid(1)
        rank = srv.cluster.rank_pids()[1][0]
        old = _group(driver)
        assert rank in old and len(old) >= 3                  # the driver, its rank, the ranks' fork server
        prompt = list(range(20, 60))

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                return await asyncio.gather(*(_complete(c, prompt, 400, None) for _ in range(3)))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(asyncio.run, burst())
            srv.wait_for("requests decoding", lambda: srv.metrics()["vllm:num_requests_running"] >= 1, 60)
            os.kill(rank, signal.SIGKILL)
            results = fut.result(120)
        for r in results:
            assert r["status"] == 200 and len(r["token_ids"]) == 400 or \
                r["error"] == "worker lost: decode worker 1 stopped", r
        assert any(r["error"] for r in results)
        print(f"\nafter the rank's kill: {[r['error'] or len(r['token_ids']) for r in results]}")
        srv.wait_for("the decode group to be replaced",
                     lambda: srv.pid(1) not in (driver, None) and srv.health() == 200, 60)
        srv.wait_for("the old group's processes to exit", lambda: all(_gone(p) for p in old), 10)
        new_ranks = srv.cluster.rank_pids()[1]
        assert len(new_ranks) == 1 and new_ranks[0] not in old and psutil.pid_exists(new_ranks[0])
        got = asyncio.run(_one(srv.url, prompt))
        assert got["status"] == 200
        want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True))
        assert got["token_ids"] == want[0].outputs[0].token_ids
    finally:
        srv.stop()


async def _one(url: str, prompt: list[int]) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        return await _complete(c, prompt, OUT, None)


def test_deploy_flag_maps_to_workers_and_degrees(tiny, monkeypatch, capsys):
    """Protects `tandem serve --deploy` (the planner's deployment syntax, its parser): P:tp2x1,D:tp1x2 starts one
    prefill worker at tp=2 and two decode workers at tp=1; a bad deployment is one line and exit status 2."""
    seen: list[ClusterConfig] = []

    def fake_serving(cfg, *a, **k):
        seen.append(cfg)
        raise CLIError("stopped before starting")
    monkeypatch.setattr("tandem.cli.serve_cmd.serving", fake_serving)
    assert main(["serve", "--model", tiny, "--deploy", "P:tp2x1,D:tp1x2"]) == 2
    cfg = seen[0]
    assert (cfg.prefill_workers, cfg.decode_workers, cfg.colocated) == (1, 2, 0)
    assert cfg.role_tp == {"prefill": 2, "decode": 1}
    capsys.readouterr()
    for deploy, line in [("P:tp2x1", "--deploy: a disaggregated deployment needs at least one prefill (P:) and one "
                                     "decode (D:) group"),
                         ("P:tp2ep2x1,D:tp1x1", "--deploy: expert parallelism (ep2) is not run by the live server "
                                                "yet")]:
        assert main(["serve", "--model", tiny, "--deploy", deploy]) == 2
        assert capsys.readouterr().err == f"tandem: error: {line}\n"
